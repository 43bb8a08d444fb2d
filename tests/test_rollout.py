"""Zero-downtime rollout as an operator and the clients around them see it: a real daemon on tiny model A rolls out
tiny model B while long streams and a steady trickle of new requests run; nothing fails or is cut short, every
stream comes from the weights its chunks name, and old workers exit 0 after their last stream.

One real daemon per capability: a surge rollout under traffic, and streams migrated past the drain timeout. The
in-place strategy is shown in process (test_worker_pool.py's in-place test, test_rollout_plan.py's "never two
groups down" over every pace, test_health_states.py's draining and new workers holding no health back), and
on_drain_timeout abort too (test_scheduler_drain.py for the scheduler's final deltas, test_request_session.py for
the client's finish reason and the ledger's row)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import Daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.llm import LLM
from tokend.v1 import tokend_pb2 as pb

LONG_STREAMS = 16
LONG_TOKENS = 1000
# Streams that must outlast a new worker's start: 2-3 s idle (about 300 of their tokens), but on a machine with busy
# processes beside the suite (and more) A decoded all of 1,000 before B was ready (one busy run's failure): twice that.
DRAIN_TOKENS = 2000
CHECKED_TOKENS = 200  # of a migrated stream's continuation, compared with the new weights' own greedy tokens
SHORT_TOKENS = 16
NEW_REQUESTS_PER_S = 2.0
LONG_PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(12)] for i in range(LONG_STREAMS)]
SHORT_PROMPTS = [[(11 * i + 3 * j) % 250 + 1 for j in range(6)] for i in range(4)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Checkpoints A (seed 1) and B (seed 2), and each one's greedy tokens for the prompts it can be asked: A for
    every prompt of the test, B for the trickle's short ones (the long streams all start before the rollout, on A:
    the test asserts that first)."""
    root = tmp_path_factory.mktemp("rollout")
    references = {}
    for name, seed, prompts in (("A", 1, LONG_PROMPTS + SHORT_PROMPTS), ("B", 2, SHORT_PROMPTS)):
        path = write_checkpoint(root / name, LLAMA_GQA, seed=seed, max_position_embeddings=4096)
        requests = [(p, LONG_TOKENS if p in LONG_PROMPTS else SHORT_TOKENS) for p in prompts]
        references[name] = {tuple(p): tokens for (p, _), tokens in zip(requests, _greedy(path, requests), strict=True)}
    return root, references


class Traffic:
    """Streams and new requests against a daemon, each recorded with when it was sent and what came back."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.results: list[dict] = []
        self.failures: list[str] = []
        self.health: list[int] = []
        self.streaming = 0  # streams that have had their first chunk
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def stream(self, prompt: list[int], max_tokens: int) -> None:
        sent = time.monotonic()
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        try:
            chunks = []
            for chunk in self.daemon.generation.Generate(request, timeout=600):
                if not chunks:
                    with self._lock:
                        self.streaming += 1
                chunks.append(chunk)
        except grpc.RpcError as error:
            with self._lock:
                self.failures.append(f"{error.code().name}: {error.details()}")
            return
        result = {
            "prompt": tuple(prompt),
            "sent": sent,
            "max_tokens": max_tokens,
            "tokens": [t for c in chunks for t in c.token_ids],
            "finish_reason": chunks[-1].finish_reason,
            "completion_tokens": chunks[-1].usage.completion_tokens,
            "generations": {c.generation for c in chunks},
            "migrated": chunks[-1].migrated,
            "chunks": [(c.generation, list(c.token_ids)) for c in chunks],
            "request_id": chunks[-1].request_id,
        }
        with self._lock:
            self.results.append(result)

    def start(self, prompt: list[int], max_tokens: int) -> None:
        thread = threading.Thread(target=self.stream, args=(prompt, max_tokens))
        thread.start()
        self._threads.append(thread)

    def trickle(self) -> None:
        """New short requests at NEW_REQUESTS_PER_S until stopped; health polled all the while."""
        count = 0
        while not self.stop.is_set():
            self.start(SHORT_PROMPTS[count % len(SHORT_PROMPTS)], SHORT_TOKENS)
            self.health.append(self._health())
            count += 1
            self.stop.wait(1.0 / NEW_REQUESTS_PER_S)

    def _health(self) -> int:
        # A generous timeout: on a loaded machine a slow answer is not a NOT_SERVING one.
        stub = health_pb2_grpc.HealthStub(self.daemon.channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status

    def join(self) -> None:
        for thread in self._threads:
            thread.join(timeout=600)

    def finished_after(self, moment: float) -> int:
        """How many requests sent after `moment` have ended (well or not)."""
        with self._lock:
            return sum(r["sent"] > moment for r in self.results) + len(self.failures)


def _generation_of(daemon: Daemon, epoch: int) -> str:
    reply = daemon.admin.GetLoad(pb.GetLoadRequest())
    return next(w.generation for w in reply.schedulers if w.epoch == epoch and w.generation)


def _wait_phase(daemon: Daemon, phases: tuple[str, ...], timeout: float) -> pb.RolloutStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = daemon.admin.GetRollout(pb.GetRolloutRequest(model="m")).rollouts[0]
        if status.phase in phases:
            return status
        time.sleep(0.2)
    raise AssertionError(f"rollout never reached {phases}: {status}")


def test_a_surge_rollout_drops_no_stream_and_each_stream_comes_from_the_weights_it_names(weights):
    root, references = weights
    flags = ["--spare-devices", "cpu", "--max-num-seqs", "32"]
    with Daemon("--model", str(root / "A"), "--served-model-name", "m", *flags) as daemon:
        generation_a = _generation_of(daemon, 0)
        traffic = Traffic(daemon)
        for prompt in LONG_PROMPTS:
            traffic.start(prompt, LONG_TOKENS)
        trickle = threading.Thread(target=traffic.trickle)
        trickle.start()
        # Every long stream decoding on A, and the trickle's first requests answered, before the rollout.
        daemon.wait_for(lambda: traffic.streaming >= LONG_STREAMS and traffic.finished_after(0) >= 2, timeout=120)
        rollout_sent = time.monotonic()
        reply = daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(root / "B"), strategy="surge"))
        assert (reply.rollout.phase, reply.rollout.strategy, reply.rollout.epoch) == ("rolling", "surge", 1)
        status = _wait_phase(daemon, ("done", "failed"), timeout=300)
        done_at = time.monotonic()
        daemon.wait_for(lambda: traffic.finished_after(done_at) >= 2, timeout=120)  # new requests after the swap
        traffic.stop.set()
        trickle.join()
        traffic.join()
        generation_b = _generation_of(daemon, 1)

        assert status.phase == "done", status
        assert traffic.failures == []
        assert all(h == health_pb2.HealthCheckResponse.SERVING for h in traffic.health), traffic.health
        assert generation_a != generation_b
        expected = {generation_a: references["A"], generation_b: references["B"]}
        for result in traffic.results:
            assert result["finish_reason"] == "length"
            assert result["completion_tokens"] == len(result["tokens"]) == result["max_tokens"]
            (generation,) = result["generations"]  # one worker, one set of weights, named on every chunk
            if result["sent"] < rollout_sent:
                assert generation == generation_a
            if result["sent"] > done_at:
                assert generation == generation_b
            assert result["tokens"] == expected[generation][result["prompt"]]
        assert len(traffic.results) >= LONG_STREAMS + 4
        # Every old worker retired on its own once its streams ended, and exited 0.
        retired = daemon.log_entries("worker_retired")
        assert {e["worker"] for e in retired} == {"m/0"}
        assert {e["exit_code"] for e in retired} == {0}
        assert [w.epoch for w in status.workers] == [1] * len(status.workers)
        # The ledger names the weights that served each request.
        with daemon.ledger() as ledger:
            rows = ledger.execute("SELECT generation, COUNT(*) FROM usage GROUP BY generation").fetchall()
        counted = {row[0]: row[1] for row in rows}
        assert set(counted) == {generation_a, generation_b}
        assert sum(counted.values()) == len(traffic.results)


def test_streams_past_the_drain_timeout_move_to_the_new_weights_and_are_billed_exactly(weights):
    """An old worker's streams still running at rollout_drain_timeout, with `--on-drain-timeout migrate`, continue
    on the new weights (greedy: B's continuation of A's tokens so far); the ledger bills the tokens the client got
    and names the weights that made them. (`abort` is shown in process: see the module's docstring.)"""
    root, references = weights
    flags = ["--spare-devices", "cpu", "--rollout-drain-timeout", "0.5", "--on-drain-timeout", "migrate"]
    with Daemon("--model", str(root / "A"), "--served-model-name", "m", *flags) as daemon:
        generation_a = _generation_of(daemon, 0)
        traffic = Traffic(daemon)
        for prompt in LONG_PROMPTS:  # a full batch: each stream far slower than a new worker's start
            traffic.start(prompt, DRAIN_TOKENS)
        daemon.wait_for(lambda: traffic.streaming >= LONG_STREAMS, timeout=120)  # every stream decoding on A
        daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(root / "B"), strategy="surge"))
        _wait_phase(daemon, ("done", "failed"), timeout=300)
        traffic.join()
        generation_b = _generation_of(daemon, 1)
        with daemon.ledger() as ledger:
            rows = ledger.execute("SELECT * FROM usage ORDER BY record_id").fetchall()

    assert traffic.failures == []
    assert len(rows) == len(traffic.results) == LONG_STREAMS
    rows_by_request = {row["request_id"]: row for row in rows}
    parts = []  # (prompt, A's tokens, the rest) of each stream
    for result in traffic.results:
        row = rows_by_request[result["request_id"]]
        assert row["completion_tokens"] == len(result["tokens"])
        assert row["prompt_tokens"] == len(result["prompt"])
        from_a = [t for generation, tokens in result["chunks"] if generation == generation_a for t in tokens]
        parts.append((list(result["prompt"]), from_a, result["tokens"][len(from_a) :]))
        assert (result["finish_reason"], row["status"]) == ("length", "finished")
        assert len(result["tokens"]) == DRAIN_TOKENS and result["migrated"] and from_a
        assert result["generations"] == {generation_a, generation_b}
        assert row["generation"] == f"{generation_a},{generation_b}"
    # A's part is A's greedy tokens (a prefix of the reference's when that is long enough: greedy tokens do not
    # depend on how many follow); the rest (its first CHECKED_TOKENS) B's greedy continuation of prompt + A's.
    longer = [(p, len(a)) for p, a, _ in parts if len(a) > LONG_TOKENS]
    recomputed = dict(zip((tuple(p) for p, _ in longer), _greedy(root / "A", longer), strict=True)) if longer else {}
    for prompt, from_a, _ in parts:
        assert from_a == recomputed.get(tuple(prompt), references["A"][tuple(prompt)][: len(from_a)])
    wanted = [(p + a, min(CHECKED_TOKENS, len(rest))) for p, a, rest in parts]
    assert _greedy(root / "B", wanted) == [rest[:CHECKED_TOKENS] for _, _, rest in parts]


def _greedy(model_dir, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """The model's greedy tokens for each (prompt, number of tokens), in one offline batch."""
    outputs = LLM(str(model_dir), max_num_seqs=len(requests)).generate(
        [{"prompt_token_ids": prompt} for prompt, _ in requests],
        [SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True) for _, count in requests],
    )
    return [o.outputs[0].token_ids for o in outputs]
