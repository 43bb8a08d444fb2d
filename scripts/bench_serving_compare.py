"""Continuous batching vs static batching vs one request at a time, end to end through the gateway, in one run
on one machine: saturation throughput on the long-tail workload, and a request-rate sweep drawn as
throughput-latency and goodput curves. Prints JSON; writes PNG plots.

    .venv/bin/python scripts/bench_serving_compare.py [--num-prompts 48] [--rates 1 2 4] [--out-dir docs/serving]

Every mode serves the same 17.8 M-parameter model from the same seeded workload through `tokend serve`'s
OpenAI gateway, measured with `tokend bench`'s own runner (vLLM's metric definitions).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import write_bench_model  # noqa: E402

from daemon.bench.backends import OpenAIBackend  # noqa: E402
from daemon.bench.datasets import long_tail_dataset  # noqa: E402
from daemon.bench.runner import run_benchmark  # noqa: E402
from daemon.local_daemon import LocalDaemon  # noqa: E402

MODES = {
    "continuous": ["--max-num-seqs", "16"],
    "static": ["--max-num-seqs", "16", "--scheduling", "static"],
    "one-at-a-time": ["--max-num-seqs", "1"],
}
SLOS_MS = {"ttft": 2000.0, "tpot": 100.0}
# Admission control off: every request is served however long it waits, so the modes are compared on the same
# work (with shedding on, a slow mode would look fast by refusing most of it).
NO_SHEDDING = [
    "--interactive-ttft-target", "1e6", "--batch-ttft-target", "1e6",
    "--batch-max-queue-wait", "1e6", "--max-queued-requests", "100000",
]  # fmt: skip


def log(message: str) -> None:
    print(f"[bench_serving_compare] {message}", file=sys.stderr, flush=True)


async def measure(url: str, requests, rate: float, seed: int) -> dict:
    backend = OpenAIBackend(url, "", None)
    try:
        return await run_benchmark(backend, requests, rate, 1.0, None, seed, SLOS_MS, progress=False)
    finally:
        await backend.close()


def run_mode(name: str, flags: list[str], model_dir: Path, args) -> dict:
    saturation_load = long_tail_dataset(args.num_prompts, 258, seed=args.seed)
    sweep_load = long_tail_dataset(args.sweep_prompts, 258, seed=args.seed + 1)
    common = ["--model", str(model_dir), "--kv-cache-bytes", str(256 << 20), *NO_SHEDDING]
    with LocalDaemon(*common, *flags, env={"TOKEND_DEBUG": "0"}) as daemon:
        asyncio.run(measure(daemon.http_url, saturation_load[:2], math.inf, args.seed))  # warm-up
        saturation = asyncio.run(measure(daemon.http_url, saturation_load, math.inf, args.seed))
        log(f"{name}: saturation {saturation['output_throughput']:.0f} output tokens/s")
        sweep = []
        for rate in args.rates:
            point = asyncio.run(measure(daemon.http_url, sweep_load, rate, args.seed))
            throughput, p99_ttft = point["output_throughput"], point["p99_ttft_ms"]
            log(f"{name}: {rate} req/s -> {throughput:.0f} tok/s, p99 TTFT {p99_ttft:.0f} ms")
            sweep.append(point)
    return {"saturation": saturation, "sweep": sweep}


def plot(results: dict, rates: list[float], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = []
    fig, (throughput_ax, latency_ax, goodput_ax) = plt.subplots(1, 3, figsize=(15, 4.5))
    for name, result in results.items():
        sweep = result["sweep"]
        throughput_ax.plot(rates, [p["output_throughput"] for p in sweep], marker="o", label=name)
        latency_ax.plot(
            [p["output_throughput"] for p in sweep], [p["p99_ttft_ms"] for p in sweep], marker="o", label=name
        )
        goodput_ax.plot(rates, [p["request_goodput"] for p in sweep], marker="o", label=name)
    throughput_ax.set(xlabel="offered requests/s", ylabel="output tokens/s", title="throughput")
    latency_ax.set(xlabel="output tokens/s", ylabel="p99 TTFT (ms)", title="throughput vs latency", yscale="log")
    goodput_ax.set(
        xlabel="offered requests/s", ylabel="requests/s meeting SLOs",
        title=f"goodput (TTFT <= {SLOS_MS['ttft']:.0f} ms, TPOT <= {SLOS_MS['tpot']:.0f} ms)",
    )  # fmt: skip
    for ax in (throughput_ax, latency_ax, goodput_ax):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out_dir / "serving_curves.png"
    fig.savefig(path, dpi=110)
    figures.append(str(path))
    return figures


def _failed(result: dict) -> int:
    return result["saturation"]["failed"] + sum(point["failed"] for point in result["sweep"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=48, help="long-tail prompts at saturation")
    parser.add_argument("--sweep-prompts", type=int, default=24, help="long-tail prompts per sweep point")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/serving"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tokend-bench-") as scratch:
        model_dir = Path(scratch) / "model"
        write_bench_model(model_dir, vocab_size=258)
        results = {name: run_mode(name, flags, model_dir, args) for name, flags in MODES.items()}
    figures = plot(results, args.rates, args.out_dir)
    saturation = {name: r["saturation"]["output_throughput"] for name, r in results.items()}
    report = {
        "benchmark": "serving_compare",
        "workload": f"long-tail, {args.num_prompts} prompts at saturation, seed {args.seed}",
        "saturation_output_tokens_per_s": saturation,
        "failed": {name: _failed(result) for name, result in results.items()},
        "continuous_vs_static": saturation["continuous"] / saturation["static"],
        "continuous_vs_one_at_a_time": saturation["continuous"] / saturation["one-at-a-time"],
        "targets": {"continuous_vs_static": 3.0, "continuous_vs_one_at_a_time": 8.0},
        "saturation_latency_ms": {
            name: {k: r["saturation"][k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_e2el_ms")}
            for name, r in results.items()
        },
        "rates": args.rates,
        "results": results,
        "figures": figures,
    }
    text = json.dumps(report, indent=2)
    (args.out_dir / "serving_compare.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
