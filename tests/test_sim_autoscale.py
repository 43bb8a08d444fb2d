"""scripts/sim_autoscale.py --smoke: the JSON a reader of docs/benchmarks/autoscale.json relies on, and tokend's
policy meeting the TTFT target on the step burst at least as often as the two reactive policies, the yardsticks, and
the reserve for the peak: a burst served by promotions, and a worker demoted back to standby finishing its streams."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"utilisation", "ongoing_requests", "reactive_ttft", "tokend", "tokend_learned_peak"}


def test_smoke_run_reports_every_trace_and_policy(tmp_path):
    # Fixed coefficients: measuring the engine is the full run's job, and it would make the suite's run vary.
    command = [sys.executable, str(ROOT / "scripts" / "sim_autoscale.py"), "--smoke", "--step-ms-base", "11.4",
               "--step-ms-per-token", "0.358", "--plot-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert set(report["traces"]) == {"step_burst", "sinusoid", "bursty_poisson"}
    params = report["params"]
    assert params["step_model"] == {"source": "flags", "base_ms": 11.4, "per_token_ms": 0.358}
    for by_policy in report["traces"].values():
        assert set(by_policy) == POLICIES
        for run in by_policy.values():
            assert 0 <= run["ttft_attainment"] <= 1 and run["worker_seconds"] > 0
            assert run["requests"] > 0 and run["scale_ups"] >= 0
            assert set(run["by_warmup_s"]) == {f"{w:g}" for w in params["warmups_s"]}
    burst = report["traces"]["step_burst"]
    for reactive in ("utilisation", "reactive_ttft"):
        assert burst["tokend"]["ttft_attainment"] >= burst[reactive]["ttft_attainment"], reactive
    assert burst["tokend"]["decisions"].get("up:ttft", 0) + burst["tokend"]["decisions"].get("up:queue", 0) >= 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert {Path(p).name for p in report["plots"]} == {"autoscale-workers.png", "autoscale-attainment.png"}


def test_the_oracle_meets_the_goal_for_no_more_worker_seconds_than_any_policy_that_meets_it():
    # In-process on a 300 s step burst, 30 s warm-up: the clairvoyant yardstick the table's bound is judged by.
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
    from autoscale_sim.cluster import Cluster
    from autoscale_sim.oracle import cheapest_oracle
    from autoscale_sim.policies import Limits
    from autoscale_sim.run import simulate
    from autoscale_sim.traces import make_trace
    from sim_autoscale import make_policies, mean_lengths, parse_args, size_requests

    from common.autoscale_policy import StepCost

    args = parse_args(["--step-ms-base", "11.4", "--step-ms-per-token", "0.358"])
    model = StepCost(11.4, 0.358)
    prompt, output, capacity = size_requests(model, args)
    trace = make_trace("step_burst", 300.0, prompt, output, seed=0)
    limits = Limits(args.min_workers, args.max_workers, args.scale_down_delay_s, args.ttft_target_s)
    cluster = lambda: Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, 30.0)  # noqa: E731
    oracle = cheapest_oracle(trace, cluster, limits, 30.0, capacity, goal=0.95)
    assert oracle["meets_goal"] and oracle["ttft_attainment"] >= 0.95
    for policy in make_policies(limits, model, 30.0, args, mean_lengths(prompt, output)):
        run = simulate(policy, trace, cluster(), limits)
        if run["ttft_attainment"] >= oracle["ttft_attainment"]:
            assert oracle["worker_seconds"] <= run["worker_seconds"], policy.name


def _setup(warmup_s: float, duration_s: float = 300.0):
    sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]
    from autoscale_sim.cluster import Cluster
    from autoscale_sim.policies import Limits
    from autoscale_sim.traces import make_trace
    from sim_autoscale import parse_args, size_requests

    from common.autoscale_policy import StepCost

    args = parse_args(["--step-ms-base", "11.4", "--step-ms-per-token", "0.358"])
    model = StepCost(11.4, 0.358)
    prompt, output, _ = size_requests(model, args)
    trace = make_trace("step_burst", duration_s, prompt, output, seed=0)
    limits = Limits(args.min_workers, args.max_workers, args.scale_down_delay_s, args.ttft_target_s)
    cluster = lambda: Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, warmup_s)  # noqa: E731
    return args, model, (prompt, output), trace, limits, cluster


def test_the_cheapest_static_fleet_is_the_smallest_that_meets_the_goal():
    from autoscale_sim.run import simulate
    from autoscale_sim.static_fleet import StaticFleet, cheapest_static_fleet

    _, _, _, trace, limits, cluster = _setup(30.0)
    fleet = cheapest_static_fleet(trace, cluster, limits, goal=0.95)
    assert fleet["meets_goal"] and fleet["ttft_attainment"] >= 0.95
    smaller = fleet["workers"] - 1
    fixed = limits.__class__(smaller, smaller, limits.scale_down_delay_s, limits.ttft_target_s)
    assert simulate(StaticFleet(smaller), trace, cluster(), fixed)["ttft_attainment"] < 0.95


def test_a_declared_peak_serves_a_burst_longer_warm_ups_cannot_reach_in_time():
    # A 300 s step burst at 120 s warm-up: the burst is over before most cold starts would serve.
    from autoscale_sim.run import simulate
    from sim_autoscale import make_policies, mean_lengths

    args, model, lengths, trace, limits, cluster = _setup(120.0)
    runs = {p.name: simulate(p, trace, cluster(), limits) for p in make_policies(limits, model, 120.0, args,
                                                                                 mean_lengths(*lengths))}  # fmt: skip
    assert runs["tokend"]["ttft_attainment"] >= 0.95
    for other in ("utilisation", "reactive_ttft", "tokend_learned_peak"):
        assert runs["tokend"]["ttft_attainment"] > runs[other]["ttft_attainment"], other


def test_a_demoted_worker_finishes_its_streams_and_serves_again_without_a_warm_up():
    from collections import deque

    from autoscale_sim.cluster import Request

    _, _, _, _, _, cluster = _setup(120.0)
    c = cluster()
    c.add_warm(0.0)
    c.add_warm(0.0)
    c.queue.extend(Request(0.0, 64, 50) for _ in range(4))
    c.advance(deque(), 0.05)
    busy = [w for w in c.workers if w.running]
    assert busy
    c.actuate(0.05, desired=1, standby=1)  # the daemon reconciler: the newest serving worker demoted, not retired
    assert len(c.workers) == 2 and len(c.standbys(0.05)) == 1
    demoted = c.standbys(0.05)[0]
    c.advance(deque(), 60.0)  # its streams run to the end, though it takes nothing new
    assert not demoted.running and all(w.running == 0 for w in c.workers)
    assert len(c.ttfts) == 4
    c.actuate(60.0, desired=2, standby=0)  # promoted again: serving at once, no warm-up
    assert len(c.serving(60.0)) == 2 and c.worker_seconds(60.0) == 120.0


def test_a_declared_peak_holds_no_more_warm_workers_than_the_fixed_fleet_it_names():
    """Issue 44: the warm reserve is the cheapest fixed fleet for the declared peak (square-root staffing over one
    worker's capacity), and a TTFT overshoot at the peak starts nothing cold beyond it: autoscaling never holds more
    workers than provisioning for the peak would, and the step burst is still served."""
    args, model, lengths, trace, limits, cluster = _setup(120.0)
    from autoscale_sim.run import simulate
    from sim_autoscale import make_policies, mean_lengths

    from common.autoscale_policy import peak_fleet, worker_capacity

    (tokend,) = [p for p in make_policies(limits, model, 120.0, args, mean_lengths(*lengths)) if p.name == "tokend"]
    capacity = worker_capacity(model, *mean_lengths(*lengths), 0.8 * args.ttft_target_s, args.max_num_seqs,
                               args.max_num_batched_tokens).requests_per_s  # fmt: skip
    fleet = peak_fleet(args.peak_rps, capacity, tokend.policy)
    assert 1 < fleet < limits.max_workers  # sized, not every worker the ceiling allows
    run = simulate(tokend, trace, cluster(), limits, record_every_s=1.0)
    assert run["ttft_attainment"] >= 0.95
    # Billed: serving, standby and loading alike (the first requests' sizes, noise, resize nothing).
    assert max(point["billed"] for point in run["timeline"]) <= fleet
    assert run["peak_desired"] <= fleet
