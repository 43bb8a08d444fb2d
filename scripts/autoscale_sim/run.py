"""One policy on one trace at one warm-up time: the control loop over the cluster, and the run's summary."""

from __future__ import annotations

from collections import deque

from autoscale_sim.cluster import Cluster, Request
from autoscale_sim.policies import Observed
from daemon.bench.metrics import percentile

TICK_S = 1.0
DRAIN_LIMIT_S = 600.0  # after the trace ends, requests still unserved by then count as misses


def simulate(policy, trace, cluster: Cluster, limits, record_every_s: float = 5.0) -> dict:
    pending = deque(Request(t, prompt, output) for t, prompt, output in trace)
    requests = list(pending)
    end = trace[-1][0] if trace else 0.0
    for _ in range(limits.min_workers):
        cluster.add_warm(0.0)
    for _ in range(policy.standby_wanted):
        cluster.add_warm(0.0, standby=True)
    seen: list[tuple[float, int, int]] = []
    timeline, desired_history = [], []
    now, scale_ups, scale_downs, last_desired = 0.0, 0, 0, limits.min_workers
    while now < end or (cluster.queue or any(w.running for w in cluster.workers)) and now < end + DRAIN_LIMIT_S:
        arrived_before = len(pending)
        cluster.advance(pending, now + TICK_S)
        now += TICK_S
        seen.extend(trace[len(trace) - arrived_before : len(trace) - len(pending)])
        busy = cluster.take_busy_fractions(now, TICK_S)
        desired = policy.tick(cluster, Observed(now=now, busy=busy, arrivals=seen))
        scale_ups += desired > last_desired
        scale_downs += desired < last_desired
        last_desired = desired
        desired_history.append(desired)
        cluster.actuate(now, desired, policy.standby_wanted)
        if now % record_every_s == 0:
            timeline.append(
                {
                    "t": now,
                    "serving": len(cluster.serving(now)),
                    "billed": cluster.billed(),
                    "queue": len(cluster.queue),
                }
            )
    ttfts = [r.first_token_at - r.arrival if r.first_token_at is not None else None for r in requests]
    return summarize(ttfts, limits.ttft_target_s, cluster.worker_seconds(now), scale_ups, scale_downs,
                     desired_history, timeline, getattr(policy, "reasons", None))  # fmt: skip


def summarize(ttfts, target_s, worker_seconds, scale_ups, scale_downs, desired, timeline, reasons) -> dict:
    served = [t for t in ttfts if t is not None]
    met = sum(t <= target_s for t in served)
    summary = {
        "ttft_attainment": round(met / len(ttfts), 4) if ttfts else None,
        "worker_seconds": round(worker_seconds, 1),
        "ttft_p50_s": _round(percentile(served, 50)),
        "ttft_p90_s": _round(percentile(served, 90)),
        "ttft_p99_s": _round(percentile(served, 99)),
        "requests": len(ttfts),
        "unserved": len(ttfts) - len(served),
        "scale_ups": scale_ups,
        "scale_downs": scale_downs,
        "peak_desired": max(desired, default=0),
        "mean_desired": round(sum(desired) / len(desired), 2) if desired else 0,
        "timeline": timeline,
    }
    if reasons is not None:
        summary["decisions"] = reasons
    return summary


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
