"""The four autoscaling policies compared: each sees the cluster at a control tick and returns the workers it wants
serving or starting toward serving (the cluster reconciles). All share the floor, ceiling and scale-down delay.

  utilisation       HPA on a GPU-utilisation gauge: desired = ceil(pods * mean busy / 0.8) every 15 s sync, a 10%
                    tolerance, unready (starting) pods counted at 0% when scaling up, and the largest
                    recommendation of the scale-down window kept (HPA's downscale stabilisation).
  ongoing_requests  Ray Serve's default: ceil(ongoing requests (queued + running), averaged over the 30 s look-back,
                    / target_ongoing_requests=2), evaluated every 10 s, up only after 30 s of wanting it.
  reactive_ttft     observed TTFT p90 of the last 30 s over the target: +1 worker (one start in flight at a time);
                    p90 under half the target with an empty queue for the scale-down delay: -1.
  tokend            the frontend's own per-tick decision (frontend.autoscale_decision.decide_pool over
                    frontend.autoscale_inputs.AutoscaleInputs): decide() on projected TTFT + queue wait and queue
                    depth, forecast_floor() over the warm-up horizon, and warm standbys for the peak (the operator's
                    declared peak rate, or the busiest window remembered, whichever is higher): the cheapest fixed
                    fleet that the peak needs (fleet_size), beyond which a declared peak starts no worker cold for
                    a TTFT overshoot; the daemon's reconciler then demotes a worker to standby while the peak's
                    reserve wants one.
  tokend_learned_peak  the same with no declared peak: it holds warm workers only for the peaks it has seen.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from autoscale_sim.cluster import Cluster
from common.autoscale_policy import (
    AutoscalePolicy,
    AutoscaleState,
    StepCost,
    peak_fleet,
    standby_target,
    worker_capacity,
)
from frontend.autoscale_decision import PoolView, Sizing, decide_pool
from frontend.autoscale_inputs import AutoscaleInputs

MODEL = "sim"


@dataclass(frozen=True, slots=True)
class Limits:
    min_workers: int
    max_workers: int
    scale_down_delay_s: float
    ttft_target_s: float

    def clamp(self, n: int) -> int:
        return max(self.min_workers, min(self.max_workers, n))


@dataclass(slots=True)
class Observed:
    """What a policy sees at a tick besides the cluster."""

    now: float
    busy: list[float]  # serving workers' busy fractions over the last tick
    arrivals: list[tuple[float, int, int]]  # every arrival so far: (time, prompt tokens, output tokens)


class Utilisation:
    name = "utilisation"
    standby_wanted = 0

    def __init__(self, limits: Limits, target: float = 0.8, sync_s: float = 15.0, tolerance: float = 0.1):
        self.limits, self.target, self.sync_s, self.tolerance = limits, target, sync_s, tolerance
        self.samples: deque[float] = deque()  # per-tick mean busy, over one sync period
        self.recommendations: deque[tuple[float, int]] = deque()
        self.desired: int | None = None

    def tick(self, cluster: Cluster, seen: Observed) -> int:
        serving, starting = len(cluster.serving(seen.now)), len(cluster.starting(seen.now, standby=False))
        current = serving + starting
        self.desired = current if self.desired is None else self.desired
        self.samples.append(sum(seen.busy) / len(seen.busy) if seen.busy else 0.0)
        if len(self.samples) < self.sync_s:
            return self.desired
        busy = sum(self.samples) / len(self.samples) * serving / max(1, current)  # unready pods at 0%
        self.samples.clear()
        ratio = busy / self.target
        recommended = current if abs(ratio - 1) <= self.tolerance else math.ceil(current * ratio)
        recommended = self.limits.clamp(recommended)
        self.recommendations.append((seen.now, recommended))
        while self.recommendations[0][0] < seen.now - self.limits.scale_down_delay_s:
            self.recommendations.popleft()
        if recommended > current:
            self.desired = recommended
        else:  # downscale stabilisation: the largest recommendation of the window
            self.desired = min(current, max(r for _, r in self.recommendations))
        return self.desired


class OngoingRequests:
    name = "ongoing_requests"
    standby_wanted = 0

    def __init__(self, limits: Limits, target_ongoing: float = 2.0, look_back_s: float = 30.0,
                 interval_s: float = 10.0, upscale_delay_s: float = 30.0):  # fmt: skip
        self.limits, self.target = limits, target_ongoing
        self.look_back_s, self.interval_s, self.upscale_delay_s = look_back_s, interval_s, upscale_delay_s
        self.ongoing: deque[tuple[float, int]] = deque()
        self.wanted_up_since: float | None = None
        self.wanted_down_since: float | None = None
        self.desired: int | None = None

    def tick(self, cluster: Cluster, seen: Observed) -> int:
        current = len(cluster.serving(seen.now)) + len(cluster.starting(seen.now, standby=False))
        self.desired = current if self.desired is None else self.desired
        self.ongoing.append((seen.now, len(cluster.queue) + sum(w.running for w in cluster.workers)))
        while self.ongoing[0][0] < seen.now - self.look_back_s:
            self.ongoing.popleft()
        if seen.now % self.interval_s:
            return self.desired
        mean = sum(n for _, n in self.ongoing) / len(self.ongoing)
        wanted = self.limits.clamp(math.ceil(mean / self.target))
        if wanted > current:
            self.wanted_down_since = None
            self.wanted_up_since = self.wanted_up_since if self.wanted_up_since is not None else seen.now
            if seen.now - self.wanted_up_since >= self.upscale_delay_s:
                self.desired, self.wanted_up_since = wanted, None
        elif wanted < current:
            self.wanted_up_since = None
            self.wanted_down_since = self.wanted_down_since if self.wanted_down_since is not None else seen.now
            if seen.now - self.wanted_down_since >= self.limits.scale_down_delay_s:
                self.desired, self.wanted_down_since = wanted, None
        else:
            self.wanted_up_since = self.wanted_down_since = None
        return self.desired


class ReactiveTtft:
    name = "reactive_ttft"
    standby_wanted = 0

    def __init__(self, limits: Limits, window_s: float = 30.0):
        self.limits, self.window_s = limits, window_s
        self.quiet_since: float | None = None
        self.seen_ttfts = 0
        self.recent: deque[tuple[float, float]] = deque()

    def tick(self, cluster: Cluster, seen: Observed) -> int:
        current = len(cluster.serving(seen.now)) + len(cluster.starting(seen.now, standby=False))
        self.recent.extend(cluster.ttfts[self.seen_ttfts :])
        self.seen_ttfts = len(cluster.ttfts)
        while self.recent and self.recent[0][0] < seen.now - self.window_s:
            self.recent.popleft()
        ttfts = sorted(t for _, t in self.recent)
        p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else 0.0
        target = self.limits.ttft_target_s
        if p90 > target:
            self.quiet_since = None
            starting = cluster.starting(seen.now, standby=False)
            return self.limits.clamp(current + (0 if starting else 1))
        if p90 < 0.5 * target and not cluster.queue:
            self.quiet_since = self.quiet_since if self.quiet_since is not None else seen.now
            if seen.now - self.quiet_since >= self.limits.scale_down_delay_s:
                self.quiet_since = seen.now
                return self.limits.clamp(current - 1)
        else:
            self.quiet_since = None
        return current


class Tokend:
    def __init__(self, limits: Limits, step_model: StepCost, warmup_s: float, min_standby: int,
                 max_num_batched_tokens: int, max_num_seqs: int, peak_rps: float = 0.0,
                 typical_request: tuple[float, float] = (0.0, 0.0), name: str = "tokend"):  # fmt: skip
        self.name = name
        self.policy = AutoscalePolicy(
            max_workers=limits.max_workers,
            min_workers=limits.min_workers,
            min_standby=min_standby,
            scale_down_delay_s=limits.scale_down_delay_s,
            peak_rps=peak_rps,
        )
        self.limits, self.warmup_s = limits, warmup_s
        self.sizing = Sizing(step_model, max_num_seqs, max_num_batched_tokens)  # known: the engine's step cost
        self.state = AutoscaleState()
        self.inputs = AutoscaleInputs(self.policy.forecast_history_s, self.policy.forecast_window_s,
                                      self.policy.peak_memory_s)  # fmt: skip
        self.fed = 0  # arrivals already given to the inputs
        self.reasons: dict[str, int] = {}
        self.desired = limits.min_workers
        # what the daemon starts with: the standbys its configured peak asks for, sized by a typical request
        target_s = self.policy.ttft_fraction * limits.ttft_target_s
        capacity = worker_capacity(step_model, *typical_request, target_s, max_num_seqs, max_num_batched_tokens)
        reserve = peak_fleet(peak_rps, capacity.requests_per_s, self.policy) or 0
        self.standby_wanted = standby_target(reserve, limits.min_workers, 0.0, self.policy, self.state)

    def tick(self, cluster: Cluster, seen: Observed) -> int:
        for arrived, prompt, output in seen.arrivals[self.fed :]:
            self.inputs.request_finished(MODEL, arrived, prompt, output)
        self.fed = len(seen.arrivals)
        arrivals = self.inputs.arrivals(MODEL)
        if not arrivals:
            return self.desired  # the load has not begun: the daemon's starting fleet holds
        prompt = sum(a[1] for a in arrivals) / len(arrivals)
        view = PoolView(
            now=seen.now,
            workers=cluster.snapshots(seen.now, prompt),
            queue_depth=len(cluster.queue),
            queue_wait_s=cluster.queue_wait_s(seen.now),
            num_standby=len(cluster.standbys(seen.now)),
            num_starting=len(cluster.starting(seen.now, standby=False)),
            arrivals=arrivals,
            window_counts=self.inputs.window_counts(MODEL),
            sizing=self.sizing,
            warmup_s=self.warmup_s,
        )
        verdict = decide_pool(view, False, 0, self.limits.ttft_target_s, self.policy, self.state)
        decision = verdict.decision
        if decision.direction != "hold":
            key = f"{decision.direction}:{decision.reason}"
            self.reasons[key] = self.reasons.get(key, 0) + 1
        self.desired, self.standby_wanted = decision.desired, verdict.standby
        return decision.desired
