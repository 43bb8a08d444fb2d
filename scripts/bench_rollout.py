"""Zero-downtime rollout under load: does time to first token hold while a daemon swaps weights A for B? Prints
JSON (and a plot with --plot). The issue's bound: TTFT p90 during the swap <= 1.5x steady state.

    .venv/bin/python scripts/bench_rollout.py [--quick] [--out rollout.json] [--plot rollout.png]

For each strategy, one daemon serving A: surge with `--device cpu@0 --spare-devices cpu@1` (B starts on the spare
group, then A's worker drains), in-place with `--device cpu@0,cpu@1` (one group at a time drains and restarts on
B). Each group is one core, as each would be one GPU on a GPU box; `--groups shared` runs every group on all the
cores instead (`--device cpu`, `--spare-devices cpu`), where B's load and warm-up take A's cores. It keeps
--long-streams greedy ignore_eos streams of --long-tokens running (each restarts as it ends) and sends short
requests (--short-tokens) at Poisson arrivals of --rate per second. TTFT (Generate sent to the first chunk with
tokens) of the short requests is measured over --steady-seconds before the Rollout call ("steady") and from the
call until the rollout's phase is done plus --tail-seconds ("swap"). Every stream must end with finish_reason
length/stop and all its tokens; those that do not are counted as failed or truncated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

import grpc

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS.parent / "tests"), str(_SCRIPTS)]  # project, harness, scripts/

from bench_engine import emit_json  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from machine_facts import machine_facts  # noqa: E402
from rollout_bench.checkpoints import write_tiny_llama  # noqa: E402
from rollout_bench.report import plot, summarize  # noqa: E402
from rollout_bench.traffic import MODEL, drive_long_streams, poisson_shorts  # noqa: E402

from common.lanes import RolloutPhase  # noqa: E402
from tokend.v1 import tokend_pb2 as pb  # noqa: E402
from tokend.v1 import tokend_pb2_grpc as pb_grpc  # noqa: E402

STRATEGY_FLAGS = {
    "pinned": {"surge": ["--device", "cpu@0", "--spare-devices", "cpu@1"], "in-place": ["--device", "cpu@0,cpu@1"]},
    "shared": {"surge": ["--device", "cpu", "--spare-devices", "cpu"], "in-place": ["--device", "cpu,cpu"]},
}
STRATEGIES = ("surge", "in-place")
FULL = dict(long_streams=16, long_tokens=2000, steady_seconds=60.0, warmup_seconds=10.0, tail_seconds=5.0)
QUICK = dict(long_streams=4, long_tokens=300, steady_seconds=10.0, warmup_seconds=2.0, tail_seconds=2.0)
ROLLOUT_TIMEOUT_S = 1200.0  # longer than the daemon's default rollout_drain_timeout (600 s), per group
POLL_S = 0.25
LOAD_SAMPLE_S = 0.5
STARTED = time.monotonic()  # for the progress lines' timestamps


def log(message: str) -> None:
    print(f"[bench_rollout {time.monotonic() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


async def wait_running(admin: pb_grpc.AdminStub, count: int, timeout: float = 120.0) -> None:
    """Until the workers' load reports show `count` sequences running: the long streams' driver is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = (await admin.GetRollout(pb.GetRolloutRequest(model=MODEL), timeout=30)).rollouts[0]
        if sum(w.num_running for w in status.workers) >= count:
            return
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"{count} long streams not running after {timeout} s")


async def sample_loads(admin: pb_grpc.AdminStub, samples: list[dict], stop: asyncio.Event) -> None:
    """The workers' load reports every LOAD_SAMPLE_S until `stop`: what the plot and the summary explain TTFT by."""
    while not stop.is_set():
        status = (await admin.GetRollout(pb.GetRolloutRequest(model=MODEL), timeout=30)).rollouts[0]
        now = time.monotonic()
        for w in status.workers:
            samples.append({"t": now, "worker_id": w.worker_id, "state": w.state, "num_running": w.num_running,
                            "num_waiting": w.num_waiting, "kv_cache_usage": w.kv_cache_usage})  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=LOAD_SAMPLE_S)


async def measure(address: str, new_path: str, strategy: str, args: argparse.Namespace) -> dict:
    """Warm-up, the steady window, the Rollout call, polling until done (or failed), the tail; the short
    requests' records and the times between (time.monotonic())."""
    async with grpc.aio.insecure_channel(address) as channel:
        generation, admin = pb_grpc.GenerationStub(channel), pb_grpc.AdminStub(channel)
        await wait_running(admin, args.long_streams)
        await asyncio.sleep(args.warmup_seconds)
        stop, loads = asyncio.Event(), []
        sampler = asyncio.create_task(sample_loads(admin, loads, stop))
        steady_start = time.monotonic()
        arrivals = asyncio.create_task(poisson_shorts(generation, args.rate, args.short_tokens, args.seed, stop))
        await asyncio.sleep(args.steady_seconds)
        rollout_called = time.monotonic()
        log(f"{strategy}: Rollout to {new_path}")
        await admin.Rollout(pb.RolloutRequest(model=MODEL, path=new_path, strategy=strategy), timeout=30)
        while True:
            status = (await admin.GetRollout(pb.GetRolloutRequest(model=MODEL), timeout=30)).rollouts[0]
            ended = status.phase in (RolloutPhase.DONE, RolloutPhase.FAILED)
            if ended or time.monotonic() - rollout_called > ROLLOUT_TIMEOUT_S:
                break
            await asyncio.sleep(POLL_S)
        rollout_ended = time.monotonic()
        log(f"{strategy}: phase {status.phase} after {rollout_ended - rollout_called:.1f} s")
        await asyncio.sleep(args.tail_seconds)
        stop.set()
        arrivals_stopped = time.monotonic()
        shorts = await arrivals
        await sampler
    workers = [{"worker_id": w.worker_id, "state": w.state, "generation": w.generation, "epoch": w.epoch}
               for w in status.workers]  # fmt: skip
    return {"steady_start": steady_start, "rollout_called": rollout_called, "rollout_ended": rollout_ended,
            "arrivals_stopped": arrivals_stopped, "phase": status.phase, "error": status.error,
            "events": list(status.events), "workers": workers, "shorts": shorts, "loads": loads}  # fmt: skip


def run_strategy(strategy: str, models: dict[str, Path], args: argparse.Namespace) -> dict:
    flags = ["--model", str(models["A"]), "--served-model-name", MODEL, *STRATEGY_FLAGS[args.groups][strategy]]
    log(f"{strategy}: starting a daemon on A")
    with LocalDaemon(*flags, env={"TOKEND_DEBUG": "0"}) as daemon:
        log(f"{strategy}: daemon serving A; {args.long_streams} long streams of {args.long_tokens} tokens")
        context = multiprocessing.get_context("spawn")  # no fork of a process holding gRPC threads
        stop, results = context.Event(), context.Queue()
        driver = context.Process(
            target=drive_long_streams,
            args=(daemon.address, args.long_streams, args.long_tokens, args.seed, stop, results),
        )
        driver.start()
        try:
            run = asyncio.run(measure(daemon.address, str(models["B"]), strategy, args))
            stop.set()
            log(f"{strategy}: waiting for the long streams to end")
            run["longs"] = results.get(timeout=ROLLOUT_TIMEOUT_S)  # before join: a full queue blocks the child
            log(f"{strategy}: stopping the daemon")
        finally:
            stop.set()
            driver.join(timeout=30)
            if driver.is_alive():
                driver.terminate()
                driver.join()
    return run


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"a reduced run (under ~2 minutes): {QUICK}")
    parser.add_argument("--strategies", default="surge,in-place", help="comma-separated: surge, in-place")
    parser.add_argument(
        "--groups",
        choices=sorted(STRATEGY_FLAGS),
        default="pinned",
        help="pinned: each group one core (cpu@0, cpu@1), as a GPU each; shared: all cores each",
    )
    parser.add_argument("--long-streams", type=int, help=f"default {FULL['long_streams']}")
    parser.add_argument("--long-tokens", type=int, help=f"default {FULL['long_tokens']}")
    parser.add_argument("--steady-seconds", type=float, help=f"default {FULL['steady_seconds']}")
    parser.add_argument("--warmup-seconds", type=float, help=f"default {FULL['warmup_seconds']}")
    parser.add_argument("--tail-seconds", type=float, help=f"default {FULL['tail_seconds']}")
    parser.add_argument("--rate", type=float, default=2.0, help="short requests per second (Poisson)")
    parser.add_argument("--short-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--plot", type=Path, help="TTFT against arrival time, per strategy (PNG)")
    args = parser.parse_args()
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = set(args.strategies) - set(STRATEGIES)
    if unknown:
        parser.error(f"--strategies: unknown {sorted(unknown)}; choose from {sorted(STRATEGIES)}")
    if args.groups == "pinned" and not {0, 1} <= os.sched_getaffinity(0):
        parser.error("--groups pinned needs cores 0 and 1; use --groups shared")
    return args


def main() -> int:
    args = parse_args()
    load_before = os.getloadavg()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="tokend-bench-rollout-") as scratch:
        # Named A and B: a generation reads "A@<hash>" or "B@<hash>".
        models = {name: write_tiny_llama(Path(scratch) / name, seed) for name, seed in (("A", 1), ("B", 2))}
        for strategy in args.strategies:
            runs[strategy] = run_strategy(strategy, models, args)
    summaries = {strategy: summarize(run) for strategy, run in runs.items()}
    result = {
        "benchmark": "rollout",
        "quick": args.quick,
        "workload": {key: getattr(args, key) for key in (*FULL, "rate", "short_tokens", "seed", "groups")},
        "strategies": summaries,
        "machine": {**machine_facts(), "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg()},
    }
    if args.plot:
        note = plot(runs, summaries, args.plot)
        if note:
            result["plot_note"] = note
            log(note)
    emit_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
