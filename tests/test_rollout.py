"""Zero-downtime rollout as an operator and the clients around them see it: a real daemon on tiny model A rolls out
tiny model B while long streams and a steady trickle of new requests run; nothing fails or is cut short, every
stream comes from the weights its chunks name, and old workers exit 0 after their last stream."""

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
LONG_TOKENS = 2000
DRAIN_TOKENS = 4000  # streams that must outlast a new worker's start
CHECKED_TOKENS = 200  # of a migrated stream's continuation, compared with the new weights' own greedy tokens
SHORT_TOKENS = 16
NEW_REQUESTS_PER_S = 2.0
LONG_PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(12)] for i in range(LONG_STREAMS)]
SHORT_PROMPTS = [[(11 * i + 3 * j) % 250 + 1 for j in range(6)] for i in range(4)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Checkpoints A (seed 1) and B (seed 2), and each one's greedy tokens for every prompt of the test."""
    root = tmp_path_factory.mktemp("rollout")
    references = {}
    for name, seed in (("A", 1), ("B", 2)):
        path = write_checkpoint(root / name, LLAMA_GQA, seed=seed, max_position_embeddings=4096)
        llm = LLM(str(path), max_num_seqs=LONG_STREAMS)
        prompts = [{"prompt_token_ids": p} for p in LONG_PROMPTS + SHORT_PROMPTS]
        params = [SamplingParams(max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)] * LONG_STREAMS
        params += [SamplingParams(max_tokens=SHORT_TOKENS, temperature=0.0, ignore_eos=True)] * len(SHORT_PROMPTS)
        outputs = llm.generate(prompts, params)
        references[name] = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
        del llm
    return root, references


class Traffic:
    """Streams and new requests against a daemon, each recorded with when it was sent and what came back."""

    def __init__(self, daemon: Daemon):
        self.daemon = daemon
        self.results: list[dict] = []
        self.failures: list[str] = []
        self.health: list[int] = []
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
            chunks = list(self.daemon.generation.Generate(request, timeout=600))
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


@pytest.mark.parametrize(
    "strategy, flags",
    [("surge", ["--spare-devices", "cpu"]), ("in-place", ["--device", "cpu,cpu"])],
)
def test_rollout_drops_no_stream_and_each_stream_comes_from_the_weights_it_names(weights, strategy, flags):
    root, references = weights
    with Daemon("--model", str(root / "A"), "--served-model-name", "m", "--max-num-seqs", "32", *flags) as daemon:
        generation_a = _generation_of(daemon, 0)
        traffic = Traffic(daemon)
        for prompt in LONG_PROMPTS:
            traffic.start(prompt, LONG_TOKENS)
        trickle = threading.Thread(target=traffic.trickle)
        trickle.start()
        time.sleep(2.0)
        rollout_sent = time.monotonic()
        reply = daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(root / "B"), strategy=strategy))
        assert (reply.rollout.phase, reply.rollout.strategy, reply.rollout.epoch) == ("rolling", strategy, 1)
        status = _wait_phase(daemon, ("done", "failed"), timeout=300)
        done_at = time.monotonic()
        time.sleep(2.0)  # new requests after the swap, too
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
            assert result["tokens"] == expected[generation][result["prompt"]]
            if result["sent"] < rollout_sent:
                assert generation == generation_a
            if result["sent"] > done_at:
                assert generation == generation_b
        assert len(traffic.results) >= LONG_STREAMS + 4
        # Every old worker retired on its own once its streams ended, and exited 0.
        retired = daemon.log_entries("worker_retired")
        assert {e["worker"] for e in retired} == ({"m/0"} if strategy == "surge" else {"m/0", "m/1"})
        assert {e["exit_code"] for e in retired} == {0}
        assert [w.epoch for w in status.workers] == [1] * len(status.workers)
        # The ledger names the weights that served each request.
        with daemon.ledger() as ledger:
            rows = ledger.execute("SELECT generation, COUNT(*) FROM usage GROUP BY generation").fetchall()
        counted = {row[0]: row[1] for row in rows}
        assert set(counted) == {generation_a, generation_b}
        assert sum(counted.values()) == len(traffic.results)


@pytest.mark.parametrize("action", ["abort", "migrate"])
def test_streams_past_the_drain_timeout_end_or_move_as_configured_and_are_billed_exactly(weights, action):
    """An old worker's streams still running at rollout_drain_timeout: `abort` ends them with finish_reason abort,
    `migrate` continues them on the new weights (greedy: B's continuation of A's tokens so far). Either way the
    ledger bills the tokens the client got, and names the weights that made them."""
    root, _ = weights
    flags = ["--spare-devices", "cpu", "--rollout-drain-timeout", "0.5", "--on-drain-timeout", action]
    with Daemon("--model", str(root / "A"), "--served-model-name", "m", *flags) as daemon:
        generation_a = _generation_of(daemon, 0)
        traffic = Traffic(daemon)
        for prompt in LONG_PROMPTS:  # a full batch: each stream far slower than a new worker's start
            traffic.start(prompt, DRAIN_TOKENS)
        time.sleep(1.0)
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
        if action == "abort":
            assert (result["finish_reason"], row["status"]) == ("abort", "cancelled")
            assert 0 < len(result["tokens"]) < DRAIN_TOKENS and result["tokens"] == from_a
            assert result["generations"] == {generation_a} and row["generation"] == generation_a
            assert not result["migrated"]
        else:
            assert (result["finish_reason"], row["status"]) == ("length", "finished")
            assert len(result["tokens"]) == DRAIN_TOKENS and result["migrated"] and from_a
            assert result["generations"] == {generation_a, generation_b}
            assert row["generation"] == f"{generation_a},{generation_b}"
    # A's part is A's greedy tokens; the rest (its first CHECKED_TOKENS) B's greedy continuation of prompt + A's.
    assert _greedy(root / "A", [(p, len(a)) for p, a, _ in parts]) == [a for _, a, _ in parts]
    if action == "migrate":
        wanted = [(p + a, min(CHECKED_TOKENS, len(rest))) for p, a, rest in parts]
        assert _greedy(root / "B", wanted) == [rest[:CHECKED_TOKENS] for _, _, rest in parts]


def _greedy(model_dir, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """The model's greedy tokens for each (prompt, number of tokens), in one offline batch."""
    outputs = LLM(str(model_dir), max_num_seqs=len(requests)).generate(
        [{"prompt_token_ids": prompt} for prompt, _ in requests],
        [SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True) for _, count in requests],
    )
    return [o.outputs[0].token_ids for o in outputs]
