"""The real daemon's side of sim_vs_daemon.py: an arrival list replayed over gRPC streaming, each request's time to
first token recorded, and the daemon's own costs that the step-time model leaves out, measured on the idle daemon:
what a request pays on its way in and its first token on its way out (frontend, IPC, client), and what each step
of the scheduler's loop adds to the engine's step (inputs drained, outputs serialized and sent)."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time

import grpc

from daemon.bench.stream_client import greedy_request, stream_generate
from tokend.v1 import tokend_pb2_grpc as pb_grpc

REQUEST_TIMEOUT_S = 600.0
VOCAB = 250  # token ids 1..VOCAB, as measure.py's prompts: below the tiny random model's vocabulary


def prompt_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(1, VOCAB + 1) for _ in range(length)]


async def generate(stub: pb_grpc.GenerationStub, prompt: list[int], max_tokens: int) -> dict:
    """One greedy ignore_eos Generate to its end: its time to first token, and the mean time per token after it."""
    stream = await stream_generate(stub, greedy_request(prompt, max_tokens), timeout=REQUEST_TIMEOUT_S)
    if stream.error is not None:
        raise RuntimeError(stream.error)
    return {"ttft": stream.ttft, "per_token_s": stream.per_token_s, "tokens": stream.tokens}


async def replay(address: str, arrivals: list[tuple[float, int, int]], seed: int) -> list[dict]:
    """Each arrival (seconds from the start, prompt tokens, output tokens) sent at its time, all concurrently; one
    record per arrival, in order: its TTFT and how late the client sent it (a disturbed client shows here)."""
    rng = random.Random(seed)
    prompts = [prompt_ids(rng, prompt) for _, prompt, _ in arrivals]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.perf_counter()

        async def one(at: float, prompt: list[int], output: int) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            late = time.perf_counter() - start - at
            result = await generate(stub, prompt, output)
            return {"arrival": at, "late_s": late, "ttft": result["ttft"], "tokens": result["tokens"]}

        return await asyncio.gather(*(one(at, p, out) for (at, _, out), p in zip(arrivals, prompts, strict=True)))


async def idle_costs(address: str, prompts: list[int], decode_tokens: int, batch: int, seed: int) -> dict:
    """On the idle daemon: each prompt alone (max_tokens=1), one after another, its TTFT; then one stream alone
    and `batch` streams together, `decode_tokens` each after a prompt of the median probe length (so that their
    attention reads a context the trace's decodes read), their gap between tokens: a decode step's wall time with
    1 and with `batch` sequences."""
    rng = random.Random(seed)
    context = int(statistics.median(prompts))
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        ttfts = [(await generate(stub, prompt_ids(rng, length), 1))["ttft"] for length in prompts]
        single = await generate(stub, prompt_ids(rng, context), decode_tokens)
        streams = (generate(stub, prompt_ids(rng, context), decode_tokens) for _ in range(batch))
        together = await asyncio.gather(*streams)
    return {
        "ttft_alone_s": ttfts,
        "decode_step_1_ms": 1e3 * single["per_token_s"],
        f"decode_step_{batch}_ms": 1e3 * statistics.median(r["per_token_s"] for r in together),
    }


class OtherLoad:
    """CPU cores that processes outside this one and the daemon's session used between start() and cores(): on a
    shared machine, how disturbed a measurement was (from /proc: the machine's busy time less ours)."""

    def __init__(self, session_id: int | None = None):
        self.session_id = session_id
        self._start = (0.0, 0, 0)

    def start(self) -> OtherLoad:
        self._start = (time.monotonic(), _busy_ticks(), self._our_ticks())
        return self

    def cores(self) -> float:
        began, busy, ours = self._start
        others = (_busy_ticks() - busy) - (self._our_ticks() - ours)
        return max(0.0, others / os.sysconf("SC_CLK_TCK") / max(1e-9, time.monotonic() - began))

    def _our_ticks(self) -> int:
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:  # it ended meanwhile
                continue
            # After the name: state, ppid, pgrp, session, ..., utime (12th), stime (13th).
            if int(entry.name) == os.getpid() or (self.session_id is not None and int(fields[3]) == self.session_id):
                total += int(fields[11]) + int(fields[12])
        return total


def _busy_ticks() -> int:
    with open("/proc/stat") as file:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, file.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal
