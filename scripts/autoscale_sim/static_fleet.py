"""A second yardstick, one that needs no foresight: the smallest fixed fleet (N workers, warm from the start, never
scaled) whose attainment reaches the goal. It is what provisioning for the peak costs. Where it spends more than a
bound allows, an online policy meets that bound only by releasing capacity it cannot get back within a warm-up, so
only by guessing right when the load will not return.
"""

from __future__ import annotations

from autoscale_sim.policies import Limits
from autoscale_sim.run import simulate


class StaticFleet:
    standby_wanted = 0

    def __init__(self, workers: int):
        self.name, self.workers = f"static_{workers}", workers

    def tick(self, cluster, seen) -> int:
        return self.workers


def cheapest_static_fleet(trace, make_cluster, limits: Limits, goal: float = 0.95) -> dict:
    """Bisects N over [min_workers, max_workers] (attainment grows with N); the summary gains `workers` and
    `meets_goal`, for the smallest N that meets it, or max_workers if none does."""
    runs: dict[int, dict] = {}

    def run(n: int) -> dict:
        if n not in runs:
            fixed = Limits(n, n, limits.scale_down_delay_s, limits.ttft_target_s)
            summary = simulate(StaticFleet(n), trace, make_cluster(), fixed)
            summary.pop("timeline")
            runs[n] = {**summary, "workers": n, "meets_goal": summary["ttft_attainment"] >= goal}
        return runs[n]

    low, high = limits.min_workers, limits.max_workers
    if not run(high)["meets_goal"]:
        return runs[high]
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if run(mid)["meets_goal"] else (mid + 1, high)
    return run(low)
