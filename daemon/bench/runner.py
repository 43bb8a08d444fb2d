"""Runs a benchmark: sends the workload open loop (Poisson or gamma arrivals) or closed loop, then summarizes."""

from __future__ import annotations

import asyncio
import math
import random
import time

from tqdm.auto import tqdm

from daemon.bench.backends import RequestResult
from daemon.bench.datasets import BenchRequest
from daemon.bench.metrics import DEFAULT_PERCENTILES, METRICS, summarize


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: gamma with shape `burstiness` and mean 1/rate (1 = Poisson), as vLLM
    draws them; all zero for an infinite rate."""
    if math.isinf(request_rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


async def run_benchmark(
    backend,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    goodput_slos_ms: dict[str, float] | None = None,
    progress: bool = True,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    percentile_metrics: tuple[str, ...] = METRICS,
) -> dict:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=not progress, desc="requests")

    async def one(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await backend.send(request)
        else:
            async with limit:
                result = await backend.send(request)
        bar.update(1)
        return result

    started = time.perf_counter()
    tasks = []
    for request, gap in zip(requests, arrival_gaps(len(requests), request_rate, burstiness, seed), strict=True):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    bar.close()
    traffic = {
        "num_prompts": len(requests),
        "request_rate": request_rate if not math.isinf(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
    }
    return traffic | summarize(results, duration, goodput_slos_ms or {}, percentiles, percentile_metrics)
