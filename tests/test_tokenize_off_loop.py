"""A huge prompt is tokenized off the frontend's event loop, or refused untokenized: other streams go on."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import Daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness.run_queue import RunQueueWait

from frontend.tokenize_pool import BULK_TEXT_CHARS, TokenizePool
from gpu_runtime.default_model import ensure_tiny_random_model
from gpu_runtime.tokenizer import Tokenizer, TooManyTokens
from tokend.v1 import tokend_pb2 as pb

BIG_PROMPT = ("Tell me everything about the history of the world. " * 80_000)[:3_900_000]  # under the 4 MiB limit


def test_the_loop_keeps_ticking_while_the_pool_tokenizes_megabytes():
    tokenizer = Tokenizer(ensure_tiny_random_model())
    text = BIG_PROMPT[:1_500_000]

    async def measure() -> tuple[float, float, int]:
        gaps: list[float] = []

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        pool = TokenizePool()
        started = time.perf_counter()
        token_ids = await pool.encode(tokenizer, text, True, max_tokens=len(text) + 1)
        took = time.perf_counter() - started
        ticker.cancel()
        pool.close()
        return took, max(gaps), len(token_ids)

    took, longest_gap, num_tokens = asyncio.run(measure())
    assert num_tokens > 1_000_000
    # On the loop itself, tokenizing would be one gap as long as the whole job.
    assert longest_gap < took / 3, (longest_gap, took)


def test_a_bulk_text_is_tokenized_below_the_usual_priority_and_a_prompt_at_it(monkeypatch):
    """A prompt of megabytes is seconds of CPU: it yields the cores to decoding; a usual prompt's TTFT waits on
    nobody. What each text's tokenizing thread ran at, read from inside the tokenizer's call."""
    tokenizer = Tokenizer(ensure_tiny_random_model())
    niceness_seen: dict[int, int] = {}
    encode = tokenizer.encode

    def encode_and_note(text, *args):
        niceness_seen[len(text)] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        return encode(text, *args)

    monkeypatch.setattr(tokenizer, "encode", encode_and_note)

    async def tokenize_both() -> None:
        pool = TokenizePool()
        try:
            for length in (100, BULK_TEXT_CHARS):
                await pool.encode(tokenizer, "x" * length, True, max_tokens=2 * length)
        finally:
            pool.close()

    asyncio.run(tokenize_both())
    usual = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert niceness_seen == {100: usual, BULK_TEXT_CHARS: niceness_seen[BULK_TEXT_CHARS]}
    assert niceness_seen[BULK_TEXT_CHARS] > usual


def test_a_prompt_past_the_token_limit_is_counted_not_listed():
    tokenizer = Tokenizer(ensure_tiny_random_model())
    with pytest.raises(TooManyTokens) as too_many:
        tokenizer.encode("x" * 5000, max_tokens=4096)
    whole = len(tokenizer.encode("x" * 5000, max_tokens=6000))
    assert whole == 5001  # one token per byte, and a BOS
    assert 4096 < too_many.value.num_tokens <= whole  # past the limit, and never more than there are


def test_a_text_far_over_the_limit_is_refused_after_tokenizing_about_twice_the_limit():
    tokenizer = Tokenizer(ensure_tiny_random_model())
    with pytest.raises(TooManyTokens) as too_many:
        tokenizer.encode(BIG_PROMPT, max_tokens=20_000)
    assert not too_many.value.exact and 20_000 < too_many.value.num_tokens <= 2 * 20_000 + 64


def test_the_refusal_benchmark_prints_what_refusing_cost():
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_prompt_refusal.py"
    command = [sys.executable, str(script), "--contexts", "4096", "65536", "--megabytes", "0.5"]
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, timeout=120).stdout)
    for row, context in zip(report["rows"], (4096, 65536), strict=True):
        assert row["context"] == context and row["refused"]
        assert context < row["tokens_counted"] <= 2 * context + 64  # counted a little past the limit, no further


def _trained_bpe(tmp_path, words_split_by: str) -> Tokenizer:
    """A real BPE with merges, trained here: the embedded model's tokenizer has one token per byte, which cannot
    show a cut changing how words merge. Words split as GPT-2 does (byte-level) or as SentencePiece does (a "▁"
    for each space and one before the text: Llama 2's and Mistral's)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    if words_split_by == "byte-level":
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = [" ".join(random.Random(seed).choices(WORDS, k=200)) for seed in range(50)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path)


WORDS = ["the", "tokenizer", "counts", "prefixes", "émigré", "naïve", "🙂", "  ", "\n", "x" * 40, "a.b,c", "42"]


@pytest.mark.parametrize("words_split_by", ["byte-level", "metaspace"])
def test_counting_by_pieces_never_refuses_a_text_that_fits_nor_overstates_one_that_does_not(tmp_path, words_split_by):
    tokenizer = _trained_bpe(tmp_path, words_split_by)
    rng = random.Random(7)
    for _ in range(40):
        text = " ".join(rng.choices(WORDS, k=rng.randint(500, 3000)))
        whole = tokenizer.backend.encode(text).ids
        assert len(whole) < 0.9 * len(text)  # merges happen: this is no byte-per-token tokenizer
        # A limit of exactly its own length: any over-count of the pieces would refuse it wrongly.
        assert tokenizer.encode(text, max_tokens=len(whole)) == whole
        with pytest.raises(TooManyTokens):
            tokenizer.encode(text, max_tokens=len(whole) - 1)
        with pytest.raises(TooManyTokens) as far_over:  # refused on its pieces' count: "at least" that many
            tokenizer.encode(text, max_tokens=len(whole) // 4)
        assert len(whole) // 4 < far_over.value.num_tokens <= len(whole)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # A context of three million tokens: of the 3.9 MB prompt (under the 32-characters-per-token bound), three million
    # tokens are counted (a second or two of work) before it is refused for its length in tokens.
    model_dir = write_checkpoint(tmp_path_factory.mktemp("long-context"), LLAMA_GQA, max_position_embeddings=3 << 20)
    # The embedded model's chat template (same byte-level tokenizer), so that a chat can be rendered too.
    shutil.copy(ensure_tiny_random_model() / "tokenizer_config.json", model_dir / "tokenizer_config.json")
    with Daemon("--model", str(model_dir)) as running:
        yield running


class HugePromptBeside:
    """The 3.9 MB prompt sent on another thread, and health checks (1 s deadline, kubelet's default timeout) every
    0.1 s for as long as it is being handled: what each check answered (None: its deadline passed), when the prompt
    was sent and refused, and the error it got."""

    def __init__(self, daemon: Daemon):
        self._daemon = daemon
        self.health: list[int | None] = []
        self.sent = self.answered = 0.0
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run)

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        sender = threading.Thread(target=self._send)
        sender.start()
        health = health_pb2_grpc.HealthStub(self._daemon.channel)
        while True:  # at least once: a fast machine may refuse the prompt before a first check could start
            try:
                self.health.append(health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                self.health.append(None)
            if not sender.is_alive():
                break
            time.sleep(0.1)
        sender.join()

    def _send(self) -> None:
        request = pb.GenerateRequest(prompt=BIG_PROMPT, sampling=pb.SamplingParams(max_tokens=4))
        self.sent = time.monotonic()
        try:
            list(self._daemon.generation.Generate(request, timeout=120))
        except grpc.RpcError as error:
            self.error = error
        self.answered = time.monotonic()


def _longest_stream_pause(
    daemon: Daemon, seconds: float, beside: HugePromptBeside | None = None
) -> tuple[float, float]:
    """The longest wait between chunks of a streaming request that runs for about `seconds` (with `beside` started
    once its first chunks are in, and on until a second after `beside` is done), and how long this process's
    threads were meanwhile kept off the CPU (RunQueueWait)."""
    request = pb.GenerateRequest(prompt="steady", sampling=pb.SamplingParams(max_tokens=100_000, ignore_eos=True))
    call = daemon.generation.Generate(request, timeout=120)
    arrivals: list[float] = []
    client_wait = RunQueueWait()
    for _ in call:
        arrivals.append(time.monotonic())
        if len(arrivals) == 5:
            client_wait.start()
            if beside is not None:
                beside.start()
        waited = arrivals[-1] - arrivals[0] > seconds
        if waited and (beside is None or not beside.is_alive() and arrivals[-1] - beside.answered > 1.0):
            call.cancel()
            break
    if beside is not None:
        beside.join()
    longest = max(later - earlier for earlier, later in zip(arrivals[4:], arrivals[5:], strict=False))
    return longest, client_wait.seconds()


def _most_failures_in_a_row(statuses: list[int | None]) -> int:
    most = run = 0
    for status in statuses:
        run = run + 1 if status is None else 0
        most = max(most, run)
    return most


def test_a_huge_prompt_stalls_no_other_stream_and_no_health_check(daemon):
    """Tokenized on the event loop, the prompt would pause every stream and health check for as long as it took.
    Off it, the stream's longest pause stays within its own pauses without the prompt (taken before and after: a
    neighbour's load on this machine may start or stop meanwhile) or under half the prompt's time (a neighbour's
    load slows it alike), plus whatever time this client was itself kept off the CPU; and no three checks in a row
    miss their 1 s deadline (kubelet's default timeout and failureThreshold: the pod would not be restarted)."""
    before, _ = _longest_stream_pause(daemon, 2.0)
    beside = HugePromptBeside(daemon)
    during, client_kept_off_the_cpu = _longest_stream_pause(daemon, 2.0, beside)
    baseline = max(before, _longest_stream_pause(daemon, 2.0)[0])
    assert beside.error is not None
    assert beside.error.code() == grpc.StatusCode.INVALID_ARGUMENT and beside.error.details().startswith("prompt: ")
    assert "tokens leave no room" in beside.error.details()  # refused for its length in tokens: it was tokenized
    answered = [status for status in beside.health if status is not None]
    assert answered and set(answered) == {health_pb2.HealthCheckResponse.SERVING}, beside.health
    assert _most_failures_in_a_row(beside.health) < 3, beside.health
    handling = beside.answered - beside.sent
    bound = max(0.5, 3 * baseline, handling / 2) + client_kept_off_the_cpu  # the latter: not the daemon's doing
    assert during < bound, (during, baseline, handling, client_kept_off_the_cpu)


def test_a_huge_chat_is_refused_naming_its_messages(daemon):
    messages = [pb.ChatMessage(role="user", content="x" * 15_000) for _ in range(256)]
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), sampling=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as refused:
        list(daemon.generation.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("chat.messages: ")
