"""Priority admission under overload: at 2x capacity, half interactive and half batch traffic, does interactive
keep its time-to-first-token target while batch is shed? Prints JSON (and a plot with --plot).

    .venv/bin/python scripts/bench_admission.py [--load 2.0] [--seconds 30] [--out result.json] [--plot ttft.png]

First measures capacity: requests/s the daemon completes with every slot busy. Then offers Poisson arrivals
at --load times that rate for --seconds, alternating interactive (tenant "chat") and batch (tenant "jobs"),
every request 64 greedy tokens, and records each one's time to first token or its RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_engine import emit_json, write_bench_model  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from daemon.bench.stream_client import greedy_request, stream_generate  # noqa: E402
from tokend.v1 import tokend_pb2_grpc as pb_grpc  # noqa: E402

OUTPUT_TOKENS = 64
MAX_NUM_SEQS = 16
DEFAULT_INTERACTIVE_TARGET_S = 2.0  # tokend's default interactive_ttft_target


def log(message: str) -> None:
    print(f"[bench_admission] {message}", file=sys.stderr, flush=True)


def config_text(interactive_target_s: float) -> str:
    tenants = [("chat", "interactive", "interactive"), ("jobs", "batch", "batch")]
    lines = [
        f"max_num_seqs = {MAX_NUM_SEQS}",
        f"interactive_ttft_target = {interactive_target_s}",
        "batch_ttft_target = 10.0",
        "batch_max_queue_wait = 5.0",
        "max_queued_requests = 128",
    ]
    for name, priority, max_priority in tenants:
        digest = hashlib.sha256(name.encode()).hexdigest()
        lines.append(f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{digest}"\n'
                     f'priority = "{priority}"\nmax_priority = "{max_priority}"')  # fmt: skip
    return "\n".join(lines) + "\n"


async def one_request(stub, index: int, tenant: str) -> dict:
    prompt = [(index * 7 + i) % 256 for i in range(32)]
    metadata = (("authorization", f"Bearer {tenant}"),)
    stream = await stream_generate(stub, greedy_request(prompt, OUTPUT_TOKENS), timeout=600, metadata=metadata)
    shed = stream.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    result = {"tenant": tenant, "sent": stream.sent, "ttft": stream.ttft, "shed": shed, "error": None}
    if stream.code is None:
        result["done"] = stream.ended
    elif not shed:
        result["error"] = stream.code.name
    return result


async def measure_capacity(address: str, num_requests: int) -> float:
    """Requests/s completed with every slot kept busy (a closed loop of MAX_NUM_SEQS clients, interactive)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        queue = list(range(num_requests))

        async def client() -> None:
            while queue:
                await one_request(stub, queue.pop(), "chat")

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(MAX_NUM_SEQS)))
        return num_requests / (time.perf_counter() - started)


async def offer_load(address: str, rate: float, seconds: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks, index, deadline = [], 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            tenant = "chat" if index % 2 == 0 else "jobs"
            tasks.append(asyncio.create_task(one_request(stub, index, tenant)))
            index += 1
            await asyncio.sleep(rng.expovariate(rate))
        return await asyncio.gather(*tasks)


def summarize(results: list[dict], tenant: str) -> dict:
    mine = [r for r in results if r["tenant"] == tenant]
    ttfts = [r["ttft"] for r in mine if r["ttft"] is not None]
    return {
        "offered": len(mine),
        "served": len(ttfts),
        "shed": sum(r["shed"] for r in mine),
        "errors": sum(r["error"] is not None for r in mine),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": max(ttfts, default=None),
    }


def plot(results: list[dict], path: Path, interactive_target_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(r["sent"] for r in results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for tenant, color in (("chat", "tab:blue"), ("jobs", "tab:orange")):
        served = [(r["sent"] - start, r["ttft"]) for r in results if r["tenant"] == tenant and r["ttft"] is not None]
        shed = [r["sent"] - start for r in results if r["tenant"] == tenant and r["shed"]]
        label = "interactive" if tenant == "chat" else "batch"
        if served:
            ax.scatter(*zip(*served, strict=True), s=8, color=color, label=f"{label}: time to first token")
        if shed:
            ax.scatter(shed, [0] * len(shed), marker="x", s=14, color=color, label=f"{label}: shed")
    ax.axhline(interactive_target_s, color="tab:blue", linestyle="--", linewidth=1, label="interactive target")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=float, default=2.0, help="offered load, in multiples of capacity")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--interactive-target", type=float, default=DEFAULT_INTERACTIVE_TARGET_S, help="seconds")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokend-bench-") as scratch:
        model_dir = Path(scratch) / "model"
        write_bench_model(model_dir, vocab_size=258)
        config = Path(scratch) / "tokend.toml"
        config.write_text(config_text(args.interactive_target))
        flags = ["--model", str(model_dir), "--config", str(config), "--kv-cache-bytes", str(256 << 20)]
        with LocalDaemon(*flags, env={"TOKEND_DEBUG": "0"}) as daemon:
            capacity = asyncio.run(measure_capacity(daemon.address, 6 * MAX_NUM_SEQS))
            log(f"capacity {capacity:.2f} requests/s; offering {args.load:.1f}x for {args.seconds:.0f} s")
            results = asyncio.run(offer_load(daemon.address, args.load * capacity, args.seconds, seed=0))
            preemptions = daemon.metric("tokend:num_preemptions_total")
    interactive, batch = summarize(results, "chat"), summarize(results, "jobs")
    sheds = interactive["shed"] + batch["shed"]
    if args.plot:
        plot(results, args.plot, args.interactive_target)
    emit_json(
        {
            "benchmark": "priority_admission",
            "output_tokens": OUTPUT_TOKENS,
            "max_num_seqs": MAX_NUM_SEQS,
            "capacity_requests_per_s": capacity,
            "offered_load": args.load,
            "seconds": args.seconds,
            "interactive": interactive,
            "batch": batch,
            "interactive_ttft_target_s": args.interactive_target,
            "interactive_p99_within_target": (interactive["ttft_p99_s"] or 0) <= args.interactive_target,
            "batch_share_of_sheds": batch["shed"] / sheds if sheds else None,
            "batch_share_of_sheds_target": 0.95,
            "preemptions": preemptions,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
