"""Prefill and decode pools against colocated workers on equal hardware: does moving prompts to a prefill worker
keep the decode streams' inter-token latency steady while long prompts arrive? Prints JSON (and a plot with
--plot).

    .venv/bin/python scripts/bench_disagg.py [--quick] [--out disagg.json] [--plot disagg.png]

Two daemons, one after the other, on the decode issue's 34M Llama (context 8,192), each worker pinned to one core
with one torch thread, chunked prefill at --chunk tokens a step in both:
  colocated       --device cpu@0,cpu@1                  two mixed workers
  disaggregated   --device cpu@0=prefill,cpu@1=decode   one prefill worker, one decode worker (pages over
                                                        ZeroMQ; disaggregated-nixl: a NIXL READ, if installed)
The traffic is the same for both: --streams greedy decode streams (short prompts, --stream-tokens each, restarted
as they end) while --long-tokens prompts arrive every --long-every seconds (--long-output tokens each), for
--seconds. Reported: p50/p99 inter-token latency of the decode streams (client side, per token), the long
prompts' time to first token, total output tokens/s, and the handover: the decode worker's pull time per long
prompt against a plain copy of the same bytes in this process. The issue's targets: p99 ITL disaggregated <= 0.5x
colocated, long-prompt TTFT <= 1.3x, output tokens/s >= 0.85x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS.parent / "tests"), str(_SCRIPTS)]  # the project, its harness

from bench_engine import MODEL_SHAPE, emit_json, write_bench_model  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from machine_facts import machine_facts  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from daemon.bench.stream_client import greedy_request, stream_generate  # noqa: E402
from gpu_runtime.kv_transfer.nixl_transport import nixl_available  # noqa: E402
from tokend.v1 import tokend_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "m"
SETUPS = {
    "colocated": ["--device", "cpu@0,cpu@1"],
    "disaggregated": ["--device", "cpu@0=prefill,cpu@1=decode", "--kv-transfer-transport", "zmq"],
    "disaggregated-nixl": ["--device", "cpu@0=prefill,cpu@1=decode", "--kv-transfer-transport", "nixl"],
}
FULL = dict(seconds=90.0, streams=16, stream_tokens=256, long_tokens=4096, long_every=10.0, long_output=16)
QUICK = dict(seconds=30.0, streams=8, stream_tokens=64, long_tokens=1024, long_every=6.0, long_output=8)
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[bench_disagg {time.monotonic() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


async def stream(stub, prompt: list[int], max_tokens: int, record: dict) -> None:
    """One greedy ignore_eos Generate; record gets its send time, (arrival time, tokens) of each chunk, its error."""
    result = await stream_generate(stub, greedy_request(prompt, max_tokens, MODEL), timeout=1800)
    record.update(sent=result.sent, chunks=result.chunks, error=result.error)


def _ms(seconds: float | None) -> float:
    return float("nan") if seconds is None else round(1e3 * seconds, 1)


async def traffic(address: str, args: argparse.Namespace) -> tuple[list[dict], list[dict], float, float]:
    """Decode streams kept running and long prompts at a fixed interval, for args.seconds; their records and the
    window's start and end."""
    rng = random.Random(args.seed)
    vocab = MODEL_SHAPE["vocab_size"]
    decodes, longs = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        start = time.monotonic()
        end = start + args.seconds

        async def decode_client(index: int) -> None:
            first = True
            while time.monotonic() < end:
                record = {"kind": "decode"}
                decodes.append(record)
                # Staggered first lengths, so streams end (and restart) all the time rather than in step.
                tokens = max(1, args.stream_tokens * (index + 1) // args.streams) if first else args.stream_tokens
                await stream(stub, [rng.randrange(vocab) for _ in range(32)], tokens, record)
                first = False

        async def long_prompts() -> None:
            tasks = []
            while time.monotonic() + args.long_every / 2 < end:
                await asyncio.sleep(args.long_every)
                record = {"kind": "long"}
                longs.append(record)
                prompt = [rng.randrange(vocab) for _ in range(args.long_tokens)]
                tasks.append(asyncio.create_task(stream(stub, prompt, args.long_output, record)))
            await asyncio.gather(*tasks)

        await asyncio.gather(*(decode_client(i) for i in range(args.streams)), long_prompts())
        return decodes, longs, start, time.monotonic()


def summarize(decodes: list[dict], longs: list[dict], start: float, end: float, window_end: float) -> dict:
    itls = []
    for record in decodes:
        chunks = record["chunks"]
        for (before, _), (at, tokens) in zip(chunks, chunks[1:], strict=False):
            if at <= window_end:
                itls.extend([(at - before) / tokens] * tokens)
    ttfts = [r["chunks"][0][0] - r["sent"] for r in longs if r["chunks"]]
    tokens = sum(n for r in decodes + longs for at, n in r["chunks"] if at <= window_end)
    return {
        "decode_itl_p50_ms": _ms(percentile(itls, 50)),
        "decode_itl_p99_ms": _ms(percentile(itls, 99)),
        "decode_itl_max_ms": round(1e3 * max(itls, default=float("nan")), 1),
        "long_prompts": len(longs),
        "long_ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "long_ttft_max_s": round(max(ttfts), 3) if ttfts else None,
        "output_tokens_per_s": round(tokens / (window_end - start), 1),
        "failed": sum(r["error"] is not None for r in decodes + longs),
        "decode_streams_finished": len(decodes),
    }


def handover(daemon: LocalDaemon, long_prompts: int) -> dict:
    """The decode worker's pulls (its metrics) per long prompt, against copying the same bytes in memory here."""
    pages = daemon.metric("tokend:kv_transfer_pages_total")
    nbytes = daemon.metric("tokend:kv_transfer_bytes_total")
    seconds = daemon.metric("tokend:kv_transfer_seconds_total")
    if not long_prompts or not nbytes:
        return {"pulled_pages": pages, "pulled_bytes": nbytes}
    per_request = int(nbytes / long_prompts)
    source = torch.randn(per_request // 4)
    copies = []
    for _ in range(5):
        began = time.perf_counter()
        source.clone()
        copies.append(time.perf_counter() - began)
    return {
        "pulled_pages": pages,
        "pulled_bytes": nbytes,
        "bytes_per_long_prompt": per_request,
        "pull_ms_per_long_prompt": round(1e3 * seconds / long_prompts, 1),
        "memcpy_ms_same_bytes": round(1e3 * statistics.median(copies), 2),
        "pull_failures": daemon.metric("tokend:kv_transfer_failures_total"),
    }


def run_setup(name: str, model_dir: Path, args: argparse.Namespace) -> tuple[dict, list[dict]]:
    flags = ["--model", str(model_dir), "--served-model-name", MODEL, "--max-model-len", "8192",
             "--max-num-batched-tokens", str(args.chunk), "--disagg-min-prompt-tokens", "256",
             *SETUPS[name]]  # fmt: skip
    log(f"{name}: starting")
    with LocalDaemon(*flags, env={"TOKEND_DEBUG": "0"}, ready_timeout=300) as daemon:
        log(f"{name}: serving; traffic for {args.seconds:g} s")
        decodes, longs, start, end = asyncio.run(traffic(daemon.address, args))
        summary = summarize(decodes, longs, start, end, start + args.seconds)
        if name != "colocated":
            summary["handover"] = handover(daemon, len(longs))
    log(f"{name}: {summary}")
    return summary, decodes


def plot(runs: dict[str, list[dict]], path: Path, window_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, decodes in runs.items():
        itls = sorted(
            1e3 * (at - before) / tokens
            for r in decodes
            for (before, _), (at, tokens) in zip(r["chunks"], r["chunks"][1:], strict=False)
        )
        if itls:
            ax.plot(itls, [i / len(itls) for i in range(len(itls))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("decode inter-token latency (ms, log)")
    ax.set_ylabel("share of tokens")
    ax.set_title(f"decode streams while long prompts arrive ({window_s:g} s each)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ratios(disaggregated: dict, colocated: dict) -> dict:
    ttfts = (disaggregated["long_ttft_p50_s"], colocated["long_ttft_p50_s"])
    return {
        "decode_itl_p99": round(disaggregated["decode_itl_p99_ms"] / colocated["decode_itl_p99_ms"], 3),
        "long_ttft_p50": round(ttfts[0] / ttfts[1], 3) if all(ttfts) else None,
        "output_tokens_per_s": round(disaggregated["output_tokens_per_s"] / colocated["output_tokens_per_s"], 3),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a reduced run: {QUICK}")
    for key, value in FULL.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(value), help=f"default {value}")
    parser.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: the prefill chunk")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, help="the decode streams' ITL distribution per setup (PNG)")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not {0, 1} <= os.sched_getaffinity(0):
        parser.error("needs cores 0 and 1 (each worker is pinned to one)")
    return args


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    summaries, runs = {}, {}
    with tempfile.TemporaryDirectory(prefix="tokend-bench-disagg-") as scratch:
        model_dir = Path(scratch) / "model"
        write_bench_model(model_dir, max_position_embeddings=8192)
        for name in SETUPS:
            if name.endswith("nixl") and not nixl_available():
                log(f"{name}: skipped, nixl is not installed")
                continue
            summaries[name], runs[name] = run_setup(name, model_dir, args)
    colocated = summaries["colocated"]
    ratios = {name: _ratios(summary, colocated) for name, summary in summaries.items() if name != "colocated"}
    result = {
        "benchmark": "disaggregated",
        "quick": args.quick,
        "workload": {key: getattr(args, key) for key in (*FULL, "chunk", "seed")},
        "setups": summaries,
        "over_colocated": ratios,
        "targets": {"decode_itl_p99": "<= 0.5", "long_ttft_p50": "<= 1.3", "output_tokens_per_s": ">= 0.85"},
        "machine": {**machine_facts(), "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg()},
    }
    if args.plot:
        plot(runs, args.plot, args.seconds)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
