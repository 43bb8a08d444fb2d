"""Does the autoscaling simulator agree with the real daemon? One trace, replayed on both (issue 19: median and p90
TTFT within 25%, 1-2 CPU workers).

    .venv/bin/python scripts/sim_vs_daemon.py [--workers 2] [--out docs/benchmarks/sim_vs_daemon.json]

In one run: the step-time model is fitted on this machine (autoscale_sim/measure.py: the tiny random engine, one
torch thread, the daemon's max_num_seqs and token budget, prefix caching off); a Poisson trace of --duration
seconds is drawn at the rate that keeps --workers simulated workers --load busy (lengths log-normal around
--prompt-tokens and --output-tokens, 4:1 as sim_autoscale.py's, clipped the same way); a `tokend serve` on the same
engine settings (--cpu-threads 1, one CPU group per worker) serves it over gRPC streaming, each request's TTFT
timed from the call to its first token; then the simulator's cluster (autoscale_sim/cluster.py, that many workers
always warm, no autoscaler) serves the same arrival list.

The daemon's own costs that the engine's step time leaves out are measured on it, idle, before the trace: a
request's way in and its first token's way out (the median of the idle TTFT of prompts drawn from the trace, less
the simulator's TTFT for each alone), and the scheduler loop's share of a decode step (the gap between tokens of
one stream and of --probe-batch streams, less the fitted step time). The simulator runs with both ("sim") and
without ("sim_engine_only"); the ratios and within_25_percent are the former's against the daemon.

JSON on stdout: {"daemon": {"ttft_p50", "ttft_p90", ...}, "sim": {...}, "sim_engine_only": {...}, "ratio_p50",
"ratio_p90", "within_25_percent", "overheads": {...}, "params": {...}}; TTFTs in seconds, ratios sim/daemon.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS.parent / "tests"), str(_SCRIPTS)]  # project, harness, scripts/

from autoscale_sim.cluster import Cluster, Request, ServingOverheads  # noqa: E402
from autoscale_sim.daemon_replay import OtherLoad, idle_costs, replay  # noqa: E402
from autoscale_sim.measure import measure_step_model  # noqa: E402
from autoscale_sim.traces import draw_length  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from machine_facts import machine_facts  # noqa: E402

from common.autoscale_policy import StepCost  # noqa: E402
from daemon.bench.metrics import percentile  # noqa: E402

TOLERANCE = 0.25
STARTED = time.monotonic()


def log(message: str) -> None:
    print(f"[sim_vs_daemon {time.monotonic() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1, choices=(1, 2), help="CPU scheduler groups")
    parser.add_argument("--duration", type=float, default=150.0, help="trace seconds")
    parser.add_argument("--load", type=float, default=0.7, help="simulated workers' busy fraction to draw at")
    parser.add_argument("--prompt-tokens", type=int, default=384, help="median prompt length")
    parser.add_argument("--output-tokens", type=int, default=96, help="median output length")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--measure-seconds", type=float, default=10.0, help="engine run to fit the step time")
    parser.add_argument("--probe-prompts", type=int, default=40, help="idle requests timed for the overhead")
    parser.add_argument("--probe-batch", type=int, default=8, help="streams decoding together for the step cost")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=20.0,
        help="a trace of this length at the same rate first, not measured: cold kernels and shapes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    return parser.parse_args(argv)


def unit_arrivals(duration_s: float, rate: float, prompt: int, output: int, seed: int) -> list[tuple[float, int, int]]:
    """Poisson arrivals at `rate` over `duration_s`, drawn from unit-rate gaps so that a higher rate is the same
    trace compressed (the busy fraction then grows with it, which the rate search relies on)."""
    rng = random.Random(f"sim_vs_daemon:{seed}")
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(1.0)
        if t / rate >= duration_s:
            return arrivals
        arrivals.append((t / rate, draw_length(rng, prompt, 16), draw_length(rng, output, 4)))


def simulate_fixed(model: StepCost, arrivals, workers: int, args, overheads: ServingOverheads | None = None):
    """The simulator's cluster with `workers` always warm and no autoscaler: each request's TTFT, and the share
    of the trace the workers spent stepping."""
    cluster = Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, warmup_s=0.0, overheads=overheads)
    for _ in range(workers):
        cluster.add_warm(0.0)
    pending = deque(Request(t, prompt, output) for t, prompt, output in arrivals)
    requests, now, busy = list(pending), 0.0, 0.0
    while pending or cluster.queue or any(w.running for w in cluster.workers):
        now += 1.0
        cluster.advance(pending, now)
        busy += sum(w.busy_s for w in cluster.workers)
        for w in cluster.workers:
            w.busy_s = 0.0
    end = arrivals[-1][0] if arrivals else 1.0
    return [r.first_token_at - r.arrival for r in requests], busy / (workers * max(end, now))


def rate_for_load(model: StepCost, args) -> tuple[float, float]:
    """The arrival rate at which the simulated workers are busy --load of the time (bisection on the rate)."""
    low, high = 0.05, 200.0
    for _ in range(30):
        mid = math.sqrt(low * high)
        arrivals = unit_arrivals(args.duration, mid, args.prompt_tokens, args.output_tokens, args.seed)
        _, busy = simulate_fixed(model, arrivals, args.workers, args)
        low, high = (mid, high) if busy < args.load else (low, mid)
    return low, busy


def summary(ttfts: list[float]) -> dict:
    return {"ttft_p50": round(percentile(ttfts, 50), 4), "ttft_p90": round(percentile(ttfts, 90), 4),
            "ttft_p99": round(percentile(ttfts, 99), 4), "ttft_mean": round(statistics.fmean(ttfts), 4),
            "requests": len(ttfts)}  # fmt: skip


def daemon_flags(args) -> list[str]:
    return ["--device", ",".join(["cpu"] * args.workers), "--cpu-threads", "1",
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--no-enable-prefix-caching", "--max-queued-requests", "4096", "--log-level", "warning"]  # fmt: skip


def measure_overheads(model: StepCost, idle: dict, probe_prompts: list[int], args) -> ServingOverheads:
    """What the daemon adds to the simulator's model, from the idle probes. Each prompt's TTFT alone against the
    simulator's for it alone gives a line, daemon = request + scale * simulator (Theil-Sen: the median of the
    pairwise slopes, robust to a probe that another process delayed): the request's fixed cost, and how much
    slower than the offline fit the daemon's steps run here and now. The decode steps' times with 1 and with
    --probe-batch sequences, less the scaled fit, give the loop's fixed and per-sequence share of a step."""
    engine_alone = [simulate_fixed(model, [(0.0, p, 1)], 1, args)[0][0] for p in probe_prompts]
    pairs = list(zip(engine_alone, idle["ttft_alone_s"], strict=True))
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pairs) for x2, y2 in pairs[i + 1 :] if x2 != x1]
    scale = max(1.0, statistics.median(slopes)) if slopes else 1.0
    request = max(0.0, statistics.median(y - scale * x for x, y in pairs))
    batch = args.probe_batch
    extra_1 = idle["decode_step_1_ms"] - scale * model.step_ms(1)
    extra_b = idle[f"decode_step_{batch}_ms"] - scale * model.step_ms(batch)
    per_sequence = max(0.0, (extra_b - extra_1) / (batch - 1))
    return ServingOverheads(request, max(0.0, extra_1 - per_sequence), per_sequence, scale)


def _rounded(value):
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return None if value is None else round(value, 5)


def main(argv=None) -> int:
    args = parse_args(argv)
    log(f"fitting the step time ({args.measure_seconds:g} s of the engine, one torch thread)")
    others = OtherLoad().start()
    model, facts = measure_step_model(args.measure_seconds, args.max_num_seqs, args.max_num_batched_tokens)
    disturbance = {"during_fit": round(others.cores(), 2)}
    log(f"step time {model.base_ms:.3f} ms + {model.per_token_ms:.4f} ms/token")
    rate, busy = rate_for_load(model, args)
    arrivals = unit_arrivals(args.duration, rate, args.prompt_tokens, args.output_tokens, args.seed)
    log(f"{len(arrivals)} arrivals at {rate:.2f}/s over {args.duration:g} s: {busy:.0%} busy in the simulator")
    probe_rng = random.Random(f"probe:{args.seed}")
    probe_prompts = [draw_length(probe_rng, args.prompt_tokens, 16) for _ in range(args.probe_prompts)]
    warm = unit_arrivals(args.warmup_seconds, rate, args.prompt_tokens, args.output_tokens, args.seed + 1)
    with LocalDaemon(*daemon_flags(args), env={"TOKEND_DEBUG": "0"}) as daemon:
        log(f"daemon serving on {args.workers} CPU group(s); {args.warmup_seconds:g} s of warm-up traffic")
        asyncio.run(replay(daemon.address, warm, args.seed + 1))
        log("probing its idle costs")
        others = OtherLoad(daemon.process.pid).start()
        idle = asyncio.run(idle_costs(daemon.address, probe_prompts, 128, args.probe_batch, args.seed))
        disturbance["during_probes"] = round(others.cores(), 2)
        log(f"replaying the trace ({args.duration:g} s)")
        others.start()
        records = asyncio.run(replay(daemon.address, arrivals, args.seed))
        disturbance["during_trace"] = round(others.cores(), 2)
    log(f"other processes' CPU cores: {disturbance}")
    stack = measure_overheads(model, idle, probe_prompts, args)
    log(
        f"overheads: {stack.request_s * 1e3:.2f} ms a request, {stack.step_ms:.3f} ms a step "
        f"+ {stack.per_sequence_ms:.4f} ms a sequence"
    )
    daemon_ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    raw, _ = simulate_fixed(model, arrivals, args.workers, args)
    corrected, _ = simulate_fixed(model, arrivals, args.workers, args, stack)
    ours, sim = summary(daemon_ttfts), summary(corrected)
    late = sorted(r["late_s"] for r in records)
    ours.update({"unfinished": len(records) - len(daemon_ttfts), "send_late_p99_s": round(percentile(late, 99), 4)})
    ratio_p50, ratio_p90 = sim["ttft_p50"] / ours["ttft_p50"], sim["ttft_p90"] / ours["ttft_p90"]
    result = {
        "daemon": ours,
        "sim": sim,
        "sim_engine_only": summary(raw),
        "ratio_p50": round(ratio_p50, 3),
        "ratio_p90": round(ratio_p90, 3),
        "within_25_percent": abs(ratio_p50 - 1) <= TOLERANCE and abs(ratio_p90 - 1) <= TOLERANCE,
        "other_processes_cores": disturbance,
        "overheads": {"request_ms": round(stack.request_s * 1e3, 3), "step_scale": round(stack.step_scale, 3),
                      "step_ms": round(stack.step_ms, 4),
                      "per_sequence_ms": round(stack.per_sequence_ms, 4),
                      **{k: _rounded(v) for k, v in idle.items()}},
        "per_request": "@@",
        "params": {**{k: v for k, v in vars(args).items() if k != "out"}, "rate_rps": round(rate, 3),
                   "sim_busy": round(busy, 3), "requests": len(arrivals), "daemon_flags": daemon_flags(args),
                   "step_model": {"base_ms": round(model.base_ms, 3), "per_token_ms": round(model.per_token_ms, 4),
                                  **facts},
                   "machine": machine_facts(), "run_seconds": round(time.monotonic() - STARTED, 1)},
    }  # fmt: skip
    # One line per request, [arrival s, prompt tokens, output tokens, daemon TTFT, sim TTFT, how late the client
    # sent it], for a later look.
    rows = [[round(t, 4), p, o, _rounded(r["ttft"]), _rounded(s), _rounded(r["late_s"])]
            for (t, p, o), r, s in zip(arrivals, records, corrected, strict=True)]  # fmt: skip
    text = json.dumps(result, indent=1).replace('"@@"', "[" + ",\n  ".join(json.dumps(row) for row in rows) + "]")
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
