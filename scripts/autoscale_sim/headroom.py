"""What a fleet actually sustains within the TTFT target: the measurement behind AutoscalePolicy.headroom.

A fleet of N workers, warm and never scaled, is fed Poisson arrivals at a constant rate (request sizes drawn as the
traces draw them); the highest rate at which it still meets the goal (95 % of first tokens within the target) is
found by bisection. N workers of worker_capacity each would serve N * capacity; they sustain less, since arrivals
and sizes vary, and a larger fleet loses a smaller share (pooling). Square-root staffing names the loss: a fleet
sustains rate r when N = a + beta * sqrt(a), a = r / capacity its offered workers; each fleet's beta is solved from
its measured r, and the policy's default headroom is their mean.
"""

from __future__ import annotations

import math
import random

from autoscale_sim.cluster import Cluster
from autoscale_sim.policies import Limits
from autoscale_sim.run import simulate
from autoscale_sim.static_fleet import StaticFleet
from autoscale_sim.traces import draw_length

FLEETS = (1, 2, 4, 6, 8)
BISECTIONS = 8


def steady_trace(rate_rps: float, duration_s: float, prompt_tokens: int, output_tokens: int, seed: int):
    rng = random.Random(f"steady:{seed}")
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate_rps)
        if t >= duration_s:
            return arrivals
        arrivals.append((t, draw_length(rng, prompt_tokens, 16), draw_length(rng, output_tokens, 4)))


def sustained_rate(workers: int, capacity_rps: float, make_cluster, trace_of, ttft_target_s: float,
                   goal: float = 0.95) -> float:  # fmt: skip
    """The highest constant arrival rate at which `workers` warm workers meet the goal (bisection)."""
    low, high = 0.3 * workers * capacity_rps, 1.2 * workers * capacity_rps
    limits = Limits(workers, workers, 60.0, ttft_target_s)
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        summary = simulate(StaticFleet(workers), trace_of(middle), make_cluster(), limits)
        low, high = (middle, high) if summary["ttft_attainment"] >= goal else (low, middle)
    return low


def measure_headroom(model, capacity_rps: float, prompt_tokens: int, output_tokens: int, args,
                     duration_s: float) -> dict:  # fmt: skip
    """Each fleet's sustained rate and the beta it implies, for one request size."""
    fleets = []
    for workers in FLEETS:
        rate = sustained_rate(
            workers,
            capacity_rps,
            lambda: Cluster(model, args.max_num_seqs, args.max_num_batched_tokens, 30.0),
            lambda r: steady_trace(r, duration_s, prompt_tokens, output_tokens, args.seed),
            args.ttft_target_s,
        )
        offered = rate / capacity_rps
        beta = (workers - offered) / math.sqrt(offered)
        fleets.append({"workers": workers, "sustained_rps": round(rate, 3), "offered_workers": round(offered, 3),
                       "share_of_capacity": round(offered / workers, 3), "beta": round(beta, 3)})  # fmt: skip
    return {"prompt_tokens_median": prompt_tokens, "output_tokens_median": output_tokens,
            "worker_capacity_rps": round(capacity_rps, 3), "fleets": fleets}  # fmt: skip
