"""The benchmark's traffic: long greedy streams kept running (in a process of their own) and Poisson arrivals of
short requests, each recorded as one dict: when it was sent, its time to first token, how it ended, and which
weights (GenerateResponse.generation) produced it."""

from __future__ import annotations

import asyncio
import contextlib
import random

import grpc

from daemon.bench.stream_client import greedy_request, stream_generate
from tokend.v1 import tokend_pb2_grpc as pb_grpc

MODEL = "m"  # the --served-model-name the benchmark's daemons use
STREAM_TIMEOUT_S = 1800.0


def prompt_ids(rng: random.Random, length: int = 16) -> list[int]:
    return [rng.randrange(256) for _ in range(length)]


async def run_stream(stub: pb_grpc.GenerationStub, kind: str, prompt: list[int], max_tokens: int) -> dict:
    """One greedy, ignore_eos Generate to its end. Times are time.monotonic(), comparable across processes."""
    stream = await stream_generate(stub, greedy_request(prompt, max_tokens, MODEL), timeout=STREAM_TIMEOUT_S)
    return {"kind": kind, "sent": stream.sent, "ttft": stream.ttft, "max_tokens": max_tokens, "tokens": stream.tokens,
            "finish_reason": stream.finish_reason, "generations": stream.generations, "migrated": stream.migrated,
            "error": stream.error, "ended": stream.ended}  # fmt: skip


def failed(record: dict) -> bool:
    """The stream broke: an RPC error, or an end other than length/stop (abort)."""
    return record["error"] is not None or record["finish_reason"] not in ("length", "stop")


def truncated(record: dict) -> bool:
    """The stream ended normally but short of its tokens (ignore_eos: every one should reach max_tokens)."""
    return not failed(record) and record["tokens"] < record["max_tokens"]


def drive_long_streams(address: str, count: int, tokens: int, seed: int, stop, results) -> None:
    """A child process's body: `count` clients, each running one long stream after another until `stop` (a
    multiprocessing Event) is set; then each lets its current stream end, and all records go on `results`.

    A process of its own, so that decoding thousands of chunks a second does not delay the short requests'
    clock in the parent. The first round's lengths are staggered (1/count .. count/count of `tokens`), so that
    streams end, and restart, all the time rather than in step: a drain always has streams to wait for."""

    async def client(stub: pb_grpc.GenerationStub, index: int) -> list[dict]:
        rng = random.Random(seed * 1000 + index)
        records = [await run_stream(stub, "long", prompt_ids(rng), max(1, tokens * (index + 1) // count))]
        while not stop.is_set():
            records.append(await run_stream(stub, "long", prompt_ids(rng), tokens))
        return records

    async def all_clients() -> list[dict]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            per_client = await asyncio.gather(*(client(stub, i) for i in range(count)))
        return [record for records in per_client for record in records]

    results.put(asyncio.run(all_clients()))


async def poisson_shorts(
    stub: pb_grpc.GenerationStub, rate: float, max_tokens: int, seed: int, stop: asyncio.Event
) -> list[dict]:
    """Short requests at Poisson arrivals of `rate` per second until `stop`; returns every one's record once all
    have ended."""
    rng = random.Random(seed)
    tasks = []
    while not stop.is_set():
        tasks.append(asyncio.create_task(run_stream(stub, "short", prompt_ids(rng), max_tokens)))
        with contextlib.suppress(TimeoutError):  # the next arrival's time came first
            await asyncio.wait_for(stop.wait(), timeout=rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))
