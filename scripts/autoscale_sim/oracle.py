"""A clairvoyant yardstick: what a policy that knows the whole trace in advance spends to meet the TTFT target.

It counts the arrivals of every `window_s` window ahead, turns each count into the workers that serve it at
`headroom` of one worker's capacity within the target (common.autoscale_policy.worker_capacity), and at each tick
asks for the most any window up to `warmup_s` ahead needs: a worker is started exactly the warm-up time before the
load that needs it, and drained as soon as no window within reach needs it. `cheapest_oracle` searches the headroom
for the fewest worker-seconds at which the attainment still reaches the goal, so each trace and warm-up time gets
the cheapest clairvoyant schedule of this shape that meets it.

That is an estimate of the floor under any online policy's cost at that attainment, not a proof: a cleverer
clairvoyant schedule could spend less. Where even the oracle misses the goal within a cost, a policy that sees only
the past will not meet it either but by luck.
"""

from __future__ import annotations

import bisect
import math

from autoscale_sim.cluster import Cluster
from autoscale_sim.policies import Limits, Observed
from autoscale_sim.run import simulate


class Oracle:
    name = "oracle"
    standby_wanted = 0

    def __init__(self, limits: Limits, trace, warmup_s: float, capacity_rps: float, headroom: float,
                 window_s: float = 10.0):  # fmt: skip
        self.limits, self.warmup_s, self.window_s = limits, warmup_s, window_s
        times = [t for t, _, _ in trace]
        end = times[-1] if times else 0.0
        self.needs = []  # workers each window needs, window i covering [i * window_s, (i + 1) * window_s)
        for i in range(int(end // window_s) + 1):
            count = bisect.bisect_left(times, (i + 1) * window_s) - bisect.bisect_left(times, i * window_s)
            self.needs.append(limits.clamp(math.ceil(count / window_s / (capacity_rps * headroom))))

    def tick(self, cluster: Cluster, seen: Observed) -> int:
        first = int(seen.now // self.window_s)
        last = int((seen.now + self.warmup_s) // self.window_s) + 1  # the window a start now first serves in, too
        ahead = self.needs[first : last + 1]
        return max(ahead) if ahead else self.limits.min_workers


def cheapest_oracle(trace, make_cluster, limits: Limits, warmup_s: float, capacity_rps: float,
                    goal: float = 0.95, steps: int = 7) -> dict:  # fmt: skip
    """The oracle's run with the fewest worker-seconds among those meeting `goal` attainment, searching its
    headroom (a bisection between 0.25 and 1.5 of capacity); the best attainment found if none meets it. The
    summary gains `headroom` and `meets_goal`."""
    low, high = 0.25, 1.5
    best = None
    for _ in range(steps):
        headroom = math.sqrt(low * high)
        summary = simulate(Oracle(limits, trace, warmup_s, capacity_rps, headroom), trace, make_cluster(), limits)
        summary.pop("timeline")
        summary.update(headroom=round(headroom, 3), meets_goal=summary["ttft_attainment"] >= goal)
        if summary["meets_goal"]:
            low = headroom  # fewer workers may still do
        else:
            high = headroom
        if best is None or _better(summary, best):
            best = summary
    return best


def _better(a: dict, b: dict) -> bool:
    if a["meets_goal"] != b["meets_goal"]:
        return a["meets_goal"]
    if a["meets_goal"]:
        return a["worker_seconds"] < b["worker_seconds"]
    return a["ttft_attainment"] > b["ttft_attainment"]
