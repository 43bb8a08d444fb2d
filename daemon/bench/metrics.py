"""The benchmark's result, with vLLM's `bench serve` names and definitions (vllm/benchmarks/serve.py).

duration runs from the first request sent to the last one finished; throughputs divide by it. TTFT is send to
first output chunk; TPOT is (E2EL - TTFT) / (output tokens - 1) per request with more than one token; ITL is every
gap between output chunks; E2EL is send to the last output chunk. max_output_tokens_per_s is the most output chunks
that arrived within one whole second of the run (one-second buckets from the first send), max_concurrent_requests
the most requests in flight at once. Latencies are reported in milliseconds, the per-request arrays in seconds.
"""

from __future__ import annotations

import math

import numpy as np

from daemon.bench.backends import RequestResult

DEFAULT_PERCENTILES = (99.0,)
METRICS = ("ttft", "tpot", "itl", "e2el")
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def summarize(
    results: list[RequestResult],
    duration: float,
    goodput_slos_ms: dict[str, float],
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
    percentile_metrics: tuple[str, ...] = METRICS,
) -> dict:
    done = [r for r in results if r.success]
    output_lens = [(r.output_tokens or len(r.itl) + 1) if r.success else 0 for r in results]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [
            (r.latency - r.ttft) / (n - 1) for r, n in zip(results, output_lens, strict=True) if r.success if n > 1
        ],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(output_lens)
    peak_tokens, peak_concurrency = _peaks(done)
    summary = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": _good(results, output_lens, goodput_slos_ms) / duration if goodput_slos_ms else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_concurrency,
    }
    for name in METRICS:
        if name in percentile_metrics:
            summary.update(_stats(name, samples[name], percentiles))
    return summary


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q`th percentile (0..100) of `values`, None for no values: the figure the benchmark scripts
    report (the summary above keeps numpy's interpolated one, under vLLM's names)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def percentile_key(name: str, p: float) -> str:
    """`p99_ttft_ms`, `p99.9_ttft_ms`: vLLM's spelling of a percentile's key."""
    return f"p{int(p) if int(p) == p else p}_{name}_ms"


def _stats(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict[str, float]:
    ms = np.asarray(seconds or [0.0], dtype=float) * 1e3  # vLLM reports 0 for a metric with no samples
    stats = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
             f"std_{name}_ms": float(ms.std())}  # fmt: skip
    for p in percentiles:
        stats[percentile_key(name, p)] = float(np.percentile(ms, p))
    return stats


def _good(results: list[RequestResult], output_lens: list[int], slos_ms: dict[str, float]) -> int:
    """Requests within every SLO; a one-token request's TPOT counts as 0, as vLLM counts it."""
    good = 0
    for r, n in zip(results, output_lens, strict=True):
        if not r.success:
            continue
        tpot = (r.latency - r.ttft) / (n - 1) if n > 1 else 0.0
        values_ms = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
        good += all(values_ms[name] <= limit for name, limit in slos_ms.items())
    return good


def _peaks(done: list[RequestResult]) -> tuple[float, int]:
    """The most output chunks in one second-long bucket, and the most requests in flight at once (a sweep over
    half-open [start, end) intervals, an end before a start at the same instant)."""
    if not done:
        return 0.0, 0
    first = min(r.start_time for r in done)
    last = max(r.start_time + r.latency for r in done)
    buckets = np.zeros(math.ceil(last - first) + 1)
    for r in done:
        token_times = r.start_time + r.ttft + np.concatenate(([0.0], np.cumsum(r.itl)))
        seconds = (token_times - first).astype(int)
        np.add.at(buckets, seconds[(seconds >= 0) & (seconds < len(buckets))], 1)
    events = sorted([(r.start_time, 1) for r in done] + [(r.start_time + r.latency, -1) for r in done])
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(buckets.max()), peak


def result_table(result: dict, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> str:
    """The result as vLLM's `bench serve` prints it (every line vLLM prints when it has a tokenizer; tokend's
    usage chunks count the tokens)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def line(label: str, value, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40} " + fmt.format(value))

    line("Successful requests:", result["completed"], "{:<10}")
    line("Failed requests:", result["failed"], "{:<10}")
    if result.get("max_concurrency") is not None:
        line("Maximum request concurrency:", result["max_concurrency"], "{:<10}")
    if result.get("request_rate", "inf") != "inf":
        line("Request rate configured (RPS):", result["request_rate"])
    line("Benchmark duration (s):", result["duration"])
    line("Total input tokens:", result["total_input_tokens"], "{:<10}")
    line("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    line("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        line("Request goodput (req/s):", result["request_goodput"])
    line("Output token throughput (tok/s):", result["output_throughput"])
    line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    line("Peak concurrent requests:", result["max_concurrent_requests"])
    line("Total token throughput (tok/s):", result["total_token_throughput"])
    for name in METRICS:
        if f"mean_{name}_ms" not in result:
            continue
        short, header = _HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        line(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        line(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            line(f"P{word} {short} (ms):", result[percentile_key(name, p)])
    lines.append("=" * 50)
    return "\n".join(lines)
