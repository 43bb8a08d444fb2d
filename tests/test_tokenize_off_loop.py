"""A huge prompt is tokenized off the frontend's event loop, or refused untokenized: other streams go on."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time

import grpc
import pytest
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import Daemon
from grpc_health.v1 import health_pb2, health_pb2_grpc

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
    assert too_many.value.num_tokens >= 5000  # one token per byte, and a BOS
    assert len(tokenizer.encode("x" * 5000, max_tokens=6000)) == too_many.value.num_tokens


def test_a_text_far_over_the_limit_is_refused_after_tokenizing_about_twice_the_limit():
    tokenizer = Tokenizer(ensure_tiny_random_model())
    with pytest.raises(TooManyTokens) as too_many:
        tokenizer.encode(BIG_PROMPT, max_tokens=20_000)
    assert not too_many.value.exact and 20_000 < too_many.value.num_tokens <= 2 * 20_000 + 64


def _trained_bpe(tmp_path) -> Tokenizer:
    """A real BPE with merges (byte-level, GPT-2's pre-tokenizer), trained here: the embedded model's tokenizer
    has one token per byte, which cannot show a prefix cut changing how words merge."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [" ".join(random.Random(seed).choices(WORDS, k=200)) for seed in range(50)]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, show_progress=False))
    backend.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path)


WORDS = ["the", "tokenizer", "counts", "prefixes", "émigré", "naïve", "🙂", "  ", "\n", "x" * 40, "a.b,c", "42"]


def test_prefix_counting_never_refuses_a_text_that_fits(tmp_path):
    tokenizer = _trained_bpe(tmp_path)
    rng = random.Random(7)
    for _ in range(40):
        text = " ".join(rng.choices(WORDS, k=rng.randint(500, 3000)))
        whole = tokenizer.backend.encode(text).ids
        assert len(whole) < 0.9 * len(text)  # merges happen: this is no byte-per-token tokenizer
        # A limit of exactly its own length: any prefix over-count would refuse it wrongly.
        assert tokenizer.encode(text, max_tokens=len(whole)) == whole
        with pytest.raises(TooManyTokens):
            tokenizer.encode(text, max_tokens=len(whole) - 1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # A context of 128k tokens: under its 32-characters-per-token bound, the 3.9 MB prompt is really tokenized
    # (seconds of work) before it is refused for the KV cache it would need.
    model_dir = write_checkpoint(tmp_path_factory.mktemp("long-context"), LLAMA_GQA, max_position_embeddings=131072)
    # The embedded model's chat template (same byte-level tokenizer), so that a chat can be rendered too.
    shutil.copy(ensure_tiny_random_model() / "tokenizer_config.json", model_dir / "tokenizer_config.json")
    with Daemon("--model", str(model_dir)) as running:
        yield running


def _stream_gaps(daemon: Daemon, seconds: float, during=None) -> float:
    """The longest wait between chunks of a streaming request running for about `seconds`, with `during` run
    on another thread meanwhile."""
    request = pb.GenerateRequest(prompt="steady", sampling=pb.SamplingParams(max_tokens=20_000, ignore_eos=True))
    call = daemon.generation.Generate(request, timeout=120)
    arrivals = []
    helper = None
    for _ in call:
        arrivals.append(time.monotonic())
        if len(arrivals) == 5 and during is not None:
            helper = threading.Thread(target=during)
            helper.start()
        if arrivals[-1] - arrivals[0] > seconds and (helper is None or not helper.is_alive()):
            call.cancel()
            break
    if helper is not None:
        helper.join()
    return max(later - earlier for earlier, later in zip(arrivals[4:], arrivals[5:], strict=False))


def test_a_huge_prompt_stalls_no_other_stream_and_no_health_check(daemon):
    outcomes: dict[str, object] = {}

    def send_big_prompt() -> None:
        request = pb.GenerateRequest(prompt=BIG_PROMPT, sampling=pb.SamplingParams(max_tokens=4))
        try:
            list(daemon.generation.Generate(request, timeout=120))
        except grpc.RpcError as error:
            outcomes["error"] = error

    def hostile() -> None:
        """The big prompt, and health checks (1 s deadline each) for as long as it is being handled."""
        sender = threading.Thread(target=send_big_prompt)
        sender.start()
        health = health_pb2_grpc.HealthStub(daemon.channel)
        statuses = []
        while True:  # at least once: a fast machine may refuse the prompt before a first check could start
            statuses.append(health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status)
            if not sender.is_alive():
                break
            time.sleep(0.1)
        sender.join()
        outcomes["health"] = statuses

    # The stream's own longest pause without the big prompt, before and after it (a neighbour's load on this
    # machine may start or stop meanwhile), sets the bound.
    before = _stream_gaps(daemon, 2.0)
    during = _stream_gaps(daemon, 2.0, during=hostile)
    baseline = max(before, _stream_gaps(daemon, 2.0))
    error = outcomes["error"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("prompt: ")
    assert "tokens leave no room" in error.details()  # refused for its length in tokens: it was tokenized (in part)
    statuses = outcomes["health"]
    assert statuses and set(statuses) == {health_pb2.HealthCheckResponse.SERVING}, statuses
    assert during < max(1.0, 3 * baseline), (during, baseline)


def test_a_huge_chat_is_refused_naming_its_messages(daemon):
    messages = [pb.ChatMessage(role="user", content="x" * 15_000) for _ in range(256)]
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages), sampling=pb.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as refused:
        list(daemon.generation.Generate(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("chat.messages: ")
