"""The benchmark's result, with vLLM's `bench serve` names and definitions.

duration runs from the first request sent to the last one finished; throughputs divide by it. TTFT is send to
first content chunk; TPOT is (E2EL - TTFT) / (output tokens - 1) per request with more than one token; ITL is
every gap between content chunks; E2EL is send to last byte. All latencies are reported in milliseconds.
"""

from __future__ import annotations

import numpy as np

from daemon.bench.backends import RequestResult

PERCENTILES = (90, 99)


def summarize(results: list[RequestResult], duration: float, goodput_slos_ms: dict[str, float]) -> dict:
    done = [r for r in results if r.success]
    ttft = [r.ttft for r in done]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itl = [gap for r in done for gap in r.itl]
    e2el = [r.latency for r in done]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if goodput_slos_ms:
        good = sum(1 for r in done if _meets(r, goodput_slos_ms))
        summary["request_goodput"] = good / duration
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        summary.update(_stats(name, values))
    summary["errors"] = sorted({r.error for r in results if r.error})[:5]
    return summary


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds, dtype=float) * 1e3 if seconds else np.zeros(1)
    stats = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return stats


def _meets(result: RequestResult, slos_ms: dict[str, float]) -> bool:
    tpot = (result.latency - result.ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0
    values_ms = {"ttft": result.ttft * 1e3, "tpot": tpot * 1e3, "e2el": result.latency * 1e3}
    return all(values_ms[name] <= limit for name, limit in slos_ms.items())
