"""Autoscaling policies side by side in a discrete-time simulation of continuous-batching workers (issue 19).

    .venv/bin/python scripts/sim_autoscale.py [--quick | --smoke] [--plot-dir docs/benchmarks] > autoscale.json

Workers step as the engine does (base_ms + per_token_ms * tokens per step, chunked prefill then decodes, at most
--max-num-seqs sequences), behind a frontend queue; a request's TTFT is its queue wait plus its prefill. Three
traces (step_burst, sinusoid, bursty_poisson; see autoscale_sim/traces.py), warm-up times of 30, 120 and 300 s,
and four policies (utilisation, ongoing_requests, reactive_ttft, tokend; see autoscale_sim/policies.py).

The step-time coefficients are fitted on this machine by running the real engine offline for --measure-seconds
(cold-start steps excluded, one torch thread), unless --step-ms-base and --step-ms-per-token are given;
params.step_model says which. The requests are sized to the machine: median prompt and output lengths (4:1) at
which one worker serves --worker-rps requests/s within the TTFT target (params.worker_capacity_rps), so that the
traces' 1 -> 8 requests/s need several workers however fast the engine is; --prompt-tokens/--output-tokens fix
them instead.

JSON on stdout: {"traces": {TRACE: {POLICY: {metrics at params.headline_warmup_s..., "by_warmup_s": {"30": {...},
"120": {...}, "300": {...}}}}}, "checks": [...], "params": {...}}. Metrics: ttft_attainment (share of all requests
whose first token came within the target; unserved ones count as misses), worker_seconds (every worker from its
start to its retirement: starting, standby, serving and draining alike), ttft_p50/p90/p99_s, scale_ups/_downs
(changes of the desired count), peak_desired, mean_desired, and tokend's decisions by direction:reason. checks
holds the issue's bound per trace and warm-up: where utilisation meets the target for < 80% of requests, tokend
must for >= 95% at <= 1.2x utilisation's worker-seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

_SCRIPTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_SCRIPTS.parent), str(_SCRIPTS)]  # the project's packages, then scripts/

from autoscale_sim.cluster import Cluster  # noqa: E402
from autoscale_sim.headroom import measure_headroom  # noqa: E402
from autoscale_sim.oracle import cheapest_oracle  # noqa: E402
from autoscale_sim.plots import POLICIES, plot  # noqa: E402
from autoscale_sim.policies import Limits, OngoingRequests, ReactiveTtft, Tokend, Utilisation  # noqa: E402
from autoscale_sim.run import simulate  # noqa: E402
from autoscale_sim.static_fleet import cheapest_static_fleet  # noqa: E402
from autoscale_sim.traces import HIGH, TRACES, make_trace  # noqa: E402

from common.autoscale_policy import StepCost, worker_capacity  # noqa: E402

MODES = {  # duration of each trace (s), warm-up times (s)
    "full": (1800.0, (30.0, 120.0, 300.0)),
    "quick": (600.0, (30.0, 120.0, 300.0)),
    "smoke": (300.0, (30.0,)),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="600 s traces (under two minutes)")
    mode.add_argument("--smoke", action="store_true", help="300 s traces, one warm-up time (for the test suite)")
    parser.add_argument("--step-ms-base", type=float, help="step time's fixed part, ms (with --step-ms-per-token)")
    parser.add_argument("--step-ms-per-token", type=float, help="step time per token computed, ms")
    parser.add_argument("--measure-seconds", type=float, default=10.0, help="engine run to fit the step time")
    parser.add_argument("--ttft-target-s", type=float, default=2.0)
    parser.add_argument(
        "--worker-rps",
        type=float,
        default=1.6,
        help="size the requests so one worker serves this many per second within the target",
    )
    parser.add_argument("--prompt-tokens", type=int, help="median prompt length (instead of --worker-rps)")
    parser.add_argument("--output-tokens", type=int, help="median output length (with --prompt-tokens)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=12)
    parser.add_argument("--min-standby", type=int, default=1, help="tokend_learned_peak's warm standbys")
    parser.add_argument(
        "--peak-rps",
        type=float,
        default=HIGH,
        help="tokend's declared peak arrival rate (autoscale_peak_rps); the traces peak at 8 req/s",
    )
    parser.add_argument("--scale-down-delay-s", type=float, default=60.0, help="every policy's")
    parser.add_argument("--ray-target-ongoing", type=float, default=2.0, help="Ray Serve's default is 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-dir", type=Path, help="write autoscale-*.png here (needs matplotlib)")
    parser.add_argument(
        "--measure-headroom",
        action="store_true",
        help="instead: what fleets of 1-8 workers sustain within the target at a steady rate, at two request sizes "
        "(the measurement behind the policy's headroom)",
    )
    args = parser.parse_args(argv)
    if (args.step_ms_base is None) != (args.step_ms_per_token is None):
        parser.error("--step-ms-base and --step-ms-per-token go together")
    if (args.prompt_tokens is None) != (args.output_tokens is None):
        parser.error("--prompt-tokens and --output-tokens go together")
    return args


def step_model_from(args) -> tuple[StepCost, dict]:
    if args.step_ms_base is not None:
        model = StepCost(args.step_ms_base, args.step_ms_per_token)
        return model, {"source": "flags", "base_ms": model.base_ms, "per_token_ms": model.per_token_ms}
    from autoscale_sim.measure import measure_step_model

    model, facts = measure_step_model(args.measure_seconds, args.max_num_seqs, args.max_num_batched_tokens)
    return model, {"source": "measured", "base_ms": round(model.base_ms, 3),
                   "per_token_ms": round(model.per_token_ms, 4), **facts}  # fmt: skip


def size_requests(model: StepCost, args) -> tuple[int, int, float]:
    """Median prompt and output lengths (4:1) at which one worker's capacity within the TTFT target is
    --worker-rps, so that the traces' 1 -> 8 requests/s need several workers whatever the machine's speed."""

    def capacity(output: int) -> float:
        return worker_capacity(model, 4 * output, output, args.ttft_target_s * 0.8, args.max_num_seqs,
                               args.max_num_batched_tokens).requests_per_s  # fmt: skip

    if args.prompt_tokens is not None:
        return args.prompt_tokens, args.output_tokens, capacity_of(model, args)
    low, high = 1, 1 << 16
    while low < high:  # capacity falls as requests grow: the largest output whose capacity is >= worker_rps
        mid = (low + high + 1) // 2
        low, high = (mid, high) if capacity(mid) >= args.worker_rps else (low, mid - 1)
    return 4 * low, low, capacity(low)


def mean_lengths(prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
    """The traces' mean prompt and output lengths: log-normal around the medians, sigma 0.5 (traces.py)."""
    return prompt_tokens * math.exp(0.125), output_tokens * math.exp(0.125)


def capacity_of(model: StepCost, args) -> float:
    return worker_capacity(model, args.prompt_tokens, args.output_tokens, args.ttft_target_s * 0.8,
                           args.max_num_seqs, args.max_num_batched_tokens).requests_per_s  # fmt: skip


def make_policies(limits: Limits, model: StepCost, warmup_s: float, args, typical_request) -> list:
    def tokend(min_standby: int = args.min_standby, **options) -> Tokend:
        return Tokend(limits, model, warmup_s, min_standby, args.max_num_batched_tokens, args.max_num_seqs,
                      typical_request=typical_request, **options)  # fmt: skip

    return [
        Utilisation(limits),
        OngoingRequests(limits, target_ongoing=args.ray_target_ongoing),
        ReactiveTtft(limits),
        tokend(peak_rps=args.peak_rps, min_standby=0),  # the declared peak is its warm capacity
        tokend(name="tokend_learned_peak"),  # no declared peak: only the peaks it has seen, and min_standby
    ]


def checks(results: dict, oracle: dict, static: dict, warmups) -> list[dict]:
    """The issue's bound per trace and warm-up time; whether the clairvoyant oracle could meet it at all, and
    whether provisioning for the peak (the cheapest fixed fleet at 95 %) fits within it."""
    out = []
    for trace, by_policy in results.items():
        for warmup in warmups:
            util = by_policy["utilisation"]["by_warmup_s"][str(warmup)]
            ours = by_policy["tokend"]["by_warmup_s"][str(warmup)]
            best = oracle[trace][str(warmup)]
            fixed = static[trace][str(warmup)]
            static_ratio = fixed["worker_seconds"] / util["worker_seconds"]
            applies = util["ttft_attainment"] < 0.8
            ratio = ours["worker_seconds"] / util["worker_seconds"]
            oracle_ratio = best["worker_seconds"] / util["worker_seconds"]
            out.append({"trace": trace, "warmup_s": warmup, "applies": applies,
                        "tokend_attainment": ours["ttft_attainment"], "utilisation_attainment": util["ttft_attainment"],
                        "worker_seconds_ratio": round(ratio, 3),
                        "passes": (not applies) or (ours["ttft_attainment"] >= 0.95 and ratio <= 1.2),
                        "oracle_attainment": best["ttft_attainment"],
                        "oracle_worker_seconds_ratio": round(oracle_ratio, 3),
                        "oracle_meets_bound": best["meets_goal"] and oracle_ratio <= 1.2,
                        "static_fleet_workers": fixed["workers"],
                        "static_fleet_attainment": fixed["ttft_attainment"],
                        "static_fleet_worker_seconds_ratio": round(static_ratio, 3),
                        "static_fleet_meets_bound": fixed["meets_goal"] and static_ratio <= 1.2,
                        **_fixed_fleet_bound(ours, util, fixed)})  # fmt: skip
    return out


def _fixed_fleet_bound(ours: dict, util: dict, fixed: dict) -> dict:
    """Never more than provisioning for the peak: >= 95 % where utilisation misses it, at <= 1.0x the cheapest fixed
    fleet that meets 95 %, and <= 1.2x utilisation's worker-seconds where utilisation meets it."""
    to_fixed = ours["worker_seconds"] / fixed["worker_seconds"]
    util_meets = util["ttft_attainment"] >= 0.95
    to_util = ours["worker_seconds"] / util["worker_seconds"]
    passes = ours["ttft_attainment"] >= 0.95 and to_fixed <= 1.0 and (not util_meets or to_util <= 1.2)
    return {"tokend_to_fixed_fleet": round(to_fixed, 3), "passes_fixed_fleet_bound": passes}


def headroom_report(args) -> dict:
    """Fleets' sustained rates at --worker-rps's request sizes and at requests a quarter as long, and the
    square-root staffing headroom they imply (autoscale_sim/headroom.py)."""
    model, model_facts = step_model_from(args)
    duration = MODES["smoke" if args.smoke else "quick" if args.quick else "full"][0] / 2
    sizes = []
    for worker_rps in (args.worker_rps, 4 * args.worker_rps):
        prompt, output, _ = size_requests(model, argparse.Namespace(**{**vars(args), "worker_rps": worker_rps}))
        mean_prompt, mean_output = mean_lengths(prompt, output)
        capacity = worker_capacity(model, mean_prompt, mean_output, args.ttft_target_s * 0.8, args.max_num_seqs,
                                   args.max_num_batched_tokens).requests_per_s  # fmt: skip
        sizes.append(measure_headroom(model, capacity, prompt, output, args, duration))
    for size in sizes:  # a lone worker pools nothing: its beta says little about fleets
        betas = [fleet["beta"] for fleet in size["fleets"] if fleet["workers"] > 1]
        size["beta_mean"] = round(sum(betas) / len(betas), 3)
    # The policy's default: the larger of the sizes' betas (a fleet sized for long requests serves short ones).
    return {"sizes": sizes, "headroom": max(size["beta_mean"] for size in sizes),
            "params": {"step_model": model_facts, "steady_trace_seconds": duration, "goal": 0.95,
                       "ttft_target_s": args.ttft_target_s, "max_num_seqs": args.max_num_seqs,
                       "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed}}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.measure_headroom:
        json.dump(headroom_report(args), sys.stdout, indent=1)
        print()
        return 0
    mode = "quick" if args.quick else "smoke" if args.smoke else "full"
    duration, warmups = MODES[mode]
    model, model_facts = step_model_from(args)
    prompt_tokens, output_tokens, capacity = size_requests(model, args)
    limits = Limits(args.min_workers, args.max_workers, args.scale_down_delay_s, args.ttft_target_s)
    began = time.monotonic()
    results: dict = {}
    oracle: dict = {}
    static: dict = {}
    timelines, rates = {}, {}
    for trace_name in TRACES:
        trace = make_trace(trace_name, duration, prompt_tokens, output_tokens, args.seed)
        bins = [0] * (int(duration // 10) + 1)
        for t, _, _ in trace:
            bins[int(t // 10)] += 1
        rates[trace_name] = ([10 * i + 5 for i in range(len(bins))], [n / 10 for n in bins])
        results[trace_name] = {name: {"by_warmup_s": {}} for name in POLICIES}
        oracle[trace_name] = {}
        static[trace_name] = {}
        for warmup in warmups:
            for policy in make_policies(limits, model, warmup, args, mean_lengths(prompt_tokens, output_tokens)):
                cluster = Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, warmup)
                summary = simulate(policy, trace, cluster, limits, record_every_s=5.0)
                timelines[(trace_name, warmup, policy.name)] = summary.pop("timeline")
                results[trace_name][policy.name]["by_warmup_s"][f"{warmup:g}"] = summary
            cluster = lambda w=warmup: Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, w)  # noqa: E731
            oracle[trace_name][f"{warmup:g}"] = cheapest_oracle(trace, cluster, limits, warmup, capacity)
            if not static[trace_name]:  # warm from the start and never scaled: the same at every warm-up time
                fleet = cheapest_static_fleet(trace, cluster, limits)
            static[trace_name][f"{warmup:g}"] = fleet
    headline = 120.0 if 120.0 in warmups else warmups[0]
    for by_policy in results.values():
        for entry in by_policy.values():
            entry.update({k: v for k, v in entry["by_warmup_s"][f"{headline:g}"].items()})
            entry["by_warmup_s"] = entry.pop("by_warmup_s")  # keep it last
    params = {
        "mode": mode,
        "trace_seconds": duration,
        "warmups_s": list(warmups),
        "headline_warmup_s": headline,
        "step_model": model_facts,
        "ttft_target_s": args.ttft_target_s,
        "prompt_tokens_median": prompt_tokens,
        "output_tokens_median": output_tokens,
        "worker_capacity_rps": round(capacity, 3),  # one worker's requests/s within the target, as tokend plans
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "min_workers": args.min_workers,
        "max_workers": args.max_workers,
        "tokend_learned_peak_min_standby": args.min_standby,
        "tokend_peak_rps": args.peak_rps,
        "scale_down_delay_s": args.scale_down_delay_s,
        "ray_target_ongoing": args.ray_target_ongoing,
        "seed": args.seed,
        "sim_seconds": None,
    }
    labels = [f"{w:g}" for w in warmups]
    output = {"traces": results, "oracle": oracle, "static_fleet": static,
              "checks": checks(results, oracle, static, labels), "params": params}  # fmt: skip
    if args.plot_dir:
        output["plots"] = plot(output, timelines, rates, args.plot_dir)
    params["sim_seconds"] = round(time.monotonic() - began, 1)
    json.dump(output, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
