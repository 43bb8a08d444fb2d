"""Continuous batching vs static batching vs one request at a time, end to end through the gateway, in one run
on one machine: saturation throughput on the long-tail workload, and a request-rate sweep drawn as
throughput-latency and goodput curves. Prints JSON; writes PNG plots.

    .venv/bin/python scripts/bench_serving_compare.py [--num-prompts 128] [--max-num-seqs 32] [--rates 1 2 4]

`scripts/perf_report.py` runs this and renders docs/PERFORMANCE.md from its JSON.

Every mode serves the same 17.8 M-parameter model from the same seeded workload through `tokend serve`'s
OpenAI gateway, measured with `tokend bench`'s own runner (vLLM's metric definitions).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_engine import decode_step_ms_by_batch, write_bench_model  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from machine_facts import machine_facts, parameter_count  # noqa: E402

from daemon.bench.backends import OpenAIBackend  # noqa: E402
from daemon.bench.datasets import BenchRequest, long_tail_dataset  # noqa: E402
from daemon.bench.runner import run_benchmark  # noqa: E402

BYTE_VOCAB = 258  # the byte-level tokenizer's: every token detokenizes to text
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


def saturation_workload(args: argparse.Namespace) -> list[BenchRequest]:
    return long_tail_dataset(args.num_prompts, BYTE_VOCAB, seed=args.seed, max_output=args.max_output_len)


def sweep_workload(args: argparse.Namespace) -> list[BenchRequest]:
    return long_tail_dataset(args.sweep_prompts, BYTE_VOCAB, seed=args.seed + 1, max_output=args.max_output_len)


def describe(requests: list[BenchRequest]) -> dict:
    """Sizes and a fingerprint of a workload: the same seed must give the same fingerprint on any machine."""
    digest = hashlib.sha256(json.dumps([[r.prompt_token_ids, r.output_len] for r in requests]).encode())
    return {
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
        "longest_output": max(r.output_len for r in requests),
        "sha256": digest.hexdigest()[:16],
    }


def static_rows_per_output_token(requests: list[BenchRequest], batch_size: int) -> float:
    """Decode rows a static batch computes per useful output token: each batch of `batch_size` runs all its
    rows until its longest output is done (in arrival order, as the static scheduler admits them)."""
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    rows = sum(len(batch) * max(r.output_len for r in batch) for batch in batches)
    return rows / sum(r.output_len for r in requests)


def run_mode(name: str, flags: list[str], model_dir: Path, saturation_load, sweep_load, args) -> dict:
    common = ["--model", str(model_dir), "--kv-cache-bytes", str(256 << 20), *NO_SHEDDING]
    if args.cpu_threads:
        common += ["--cpu-threads", str(args.cpu_threads)]
    with LocalDaemon(*common, *flags, env={"TOKEND_DEBUG": "0"}) as daemon:
        threads = scheduler_threads(daemon)
        asyncio.run(measure(daemon.http_url, saturation_load[:2], math.inf, args.seed))  # warm-up
        saturation = asyncio.run(measure(daemon.http_url, saturation_load, math.inf, args.seed))
        log(f"{name}: saturation {saturation['output_throughput']:.0f} output tokens/s")
        sweep = []
        for rate in args.rates:
            point = asyncio.run(measure(daemon.http_url, sweep_load, rate, args.seed))
            throughput, p99_ttft = point["output_throughput"], point["p99_ttft_ms"]
            log(f"{name}: {rate} req/s -> {throughput:.0f} tok/s, p99 TTFT {p99_ttft:.0f} ms")
            sweep.append(point)
    return {"saturation": saturation, "sweep": sweep, "scheduler_torch_threads": threads}


def scheduler_threads(daemon: LocalDaemon) -> int:
    """The torch threads the daemon's scheduler runs with, as its engine_ready log line says."""
    for entry in daemon.log_entries("engine_ready"):
        return entry["torch_threads"]
    raise RuntimeError(f"the scheduler never said it was ready:\n{daemon.log()}")


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128, help="long-tail prompts at saturation")
    parser.add_argument("--sweep-prompts", type=int, default=24, help="long-tail prompts per sweep point")
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--max-num-seqs", type=int, default=32, help="batch size of continuous and static")
    parser.add_argument("--max-output-len", type=int, default=1024, help="cap on the long-tail output lengths")
    parser.add_argument("--model", type=Path, help="checkpoint to serve (default: the 17.8 M benchmark Llama)")
    parser.add_argument("--cpu-threads", type=int, help="torch threads of each daemon's scheduler (default: its own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=Path("docs/serving"))
    return parser.parse_args(argv)


def modes(max_num_seqs: int) -> dict[str, list[str]]:
    batch = ["--max-num-seqs", str(max_num_seqs)]
    return {"continuous": batch, "static": [*batch, "--scheduling", "static"], "one-at-a-time": ["--max-num-seqs", "1"]}


def run_comparison(args: argparse.Namespace) -> dict:
    """Runs every mode on the same workload; writes the JSON and the plots to `args.out_dir`; returns the JSON."""
    machine = machine_facts()  # before this run writes its figures, which may be tracked files
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    saturation_load, sweep_load = saturation_workload(args), sweep_workload(args)
    with tempfile.TemporaryDirectory(prefix="tokend-bench-") as scratch:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(scratch) / "model"
            write_bench_model(model_dir, vocab_size=BYTE_VOCAB)
        parameters = parameter_count(model_dir)
        results = {
            name: run_mode(name, flags, model_dir, saturation_load, sweep_load, args)
            for name, flags in modes(args.max_num_seqs).items()
        }
        # In process, with the schedulers' thread count, so that the step times explain the served figures.
        threads = results["continuous"]["scheduler_torch_threads"]
        default_threads = torch.get_num_threads()
        torch.set_num_threads(threads)
        step_ms = decode_step_ms_by_batch(model_dir, (1, args.max_num_seqs))
        torch.set_num_threads(default_threads)
    figures = plot(results, args.rates, args.out_dir)
    saturation = {name: r["saturation"]["output_throughput"] for name, r in results.items()}
    report = {
        "benchmark": "serving_compare",
        "machine": machine,
        "seconds": round(time.perf_counter() - started, 1),
        "model": str(args.model) if args.model else None,  # None: the benchmark Llama written for this run
        "model_parameters": parameters,
        "max_num_seqs": args.max_num_seqs,
        "scheduler_torch_threads": threads,
        "cpu_threads": args.cpu_threads,  # None: each daemon chose its own
        "seed": args.seed,
        "num_prompts": args.num_prompts,
        "sweep_prompts": args.sweep_prompts,
        "workload": {
            "saturation": describe(saturation_load),
            "sweep": describe(sweep_load),
        },
        "slos_ms": SLOS_MS,
        "saturation_output_tokens_per_s": saturation,
        "failed": {name: _failed(result) for name, result in results.items()},
        "continuous_vs_static": saturation["continuous"] / saturation["static"],
        "continuous_vs_one_at_a_time": saturation["continuous"] / saturation["one-at-a-time"],
        "targets": {"continuous_vs_static": 3.0, "continuous_vs_one_at_a_time": 8.0},
        "saturation_latency_ms": {
            name: {k: r["saturation"][k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "median_e2el_ms")}
            for name, r in results.items()
        },
        "decode_step_ms_by_batch": step_ms,
        "static_rows_per_output_token": static_rows_per_output_token(saturation_load, args.max_num_seqs),
        "rates": args.rates,
        "results": results,
        "figures": [str(Path(f).relative_to(args.out_dir)) for f in figures],
    }
    (args.out_dir / "serving_compare.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main() -> int:
    print(json.dumps(run_comparison(parse_args()), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
