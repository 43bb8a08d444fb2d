"""The autoscaler's policy as pure functions over load snapshots: no I/O, no torch, no clocks of its own.

Two loops decide how many workers serve one model:
  - the fast loop, `decide`, about once a second, watches leading indicators: the best serving worker's effective
    time to first token (its projected TTFT plus the frontend's queue wait) and the frontend's queue depth against
    the free slots of the serving workers. It scales up at once when either passes its bound, and down by one
    worker only after the load has stayed quiet for `scale_down_delay_s`. One cold start is in flight at a time;
    promotions of warm standbys are not held back (a routing flip shows in the next tick's indicators).
  - the slow loop, `forecast_floor`, every few seconds, forecasts the arrival rate and the prompt/output lengths
    over a horizon equal to the measured warm-up time, and turns them into a worker floor with the engine's own
    step-time model, so that workers are started before the load that needs them arrives. A declared peak
    (`peak_rps`) bounds how far a trend is extrapolated.

`Decision.desired` counts workers serving or starting toward serving; standbys (loaded, warm, not routed) are kept
apart by the actuator, which promotes one when `desired` grows (a routing flip) and starts a new standby behind it.
How many standbys, `standby_target`: enough that the workers warm (serving and standby) serve the peak, the
operator's `peak_rps` or the busiest window of the last `peak_memory_s` (`peak_rate`), because a burst faster than
a warm-up is served only by capacity already warm; at least `min_standby`.
Reasons are short snake_case words, fit for a Prometheus label: up for `ttft`, `queue`, `forecast` (the slow
loop's floor) or `floor` (min_workers); down for `quiet` or `ceiling` (max_workers lowered); hold for `steady`,
`quiet_wait` (quiet, the delay not yet passed), `starting` (an action in flight), `cooldown` (a change just made),
`ceiling`, `floor`, `forecast` or `peak_fleet` (the fleet a declared peak needs is warm: no cold start past it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Direction = Literal["up", "down", "hold"]


@dataclass(frozen=True, slots=True)
class WorkerSnapshot:
    """One serving worker as its scheduler reports it."""

    projected_ttft_s: float  # what a request routed here now would wait for its first token
    num_running: int
    num_waiting: int  # routed here, not yet running
    max_num_seqs: int

    @property
    def free_slots(self) -> int:
        return max(0, self.max_num_seqs - self.num_running - self.num_waiting)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One model's load at `now`: its serving workers and the frontend's queue for it."""

    now: float
    workers: list[WorkerSnapshot]
    queue_depth: int  # requests the frontend holds, routed to no worker yet
    queue_wait_s: float  # how long the oldest of them has waited
    ttft_target_s: float
    num_standby: int = 0
    num_starting: int = 0  # workers starting toward serving (not standbys being replenished)

    @property
    def effective_ttft_s(self) -> float:
        """The best serving worker's projected TTFT plus the queue wait; infinite when none serves."""
        if not self.workers:
            return math.inf
        return min(w.projected_ttft_s for w in self.workers) + self.queue_wait_s


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    max_workers: int
    ttft_fraction: float = 0.8  # scale up when the effective TTFT passes this fraction of the target
    quiet_fraction: float = 0.4  # the load is quiet while the effective TTFT stays under this fraction
    min_workers: int = 1
    min_standby: int = 0
    scale_down_delay_s: float = 60.0
    scale_up_cooldown_s: float = 5.0  # after a change, let it show in the indicators before adding again
    forecast_window_s: float = 30.0  # the slow loop's bucket width for arrival rates
    forecast_history_s: float = 300.0  # how far back the slow loop looks
    # Workers beyond a load's offered workers a (its rate over one worker's capacity), in units of sqrt(a): a fleet
    # of N sustains less than N workers' capacity within the target, since arrivals and request sizes vary, and a
    # larger fleet loses less of it (square-root staffing; fleet_size). 0.2 is measured: fleets of 2 to 8 at a
    # steady rate need 0.19 on average for long requests, 0.09 for short ones (docs/benchmarks/autoscale-headroom.json).
    headroom: float = 0.2
    peak_rps: float = 0.0  # the arrival rate the operator expects at peak: warm workers are kept for it
    peak_memory_s: float = 3600.0  # how long the highest arrival rate seen is remembered as a peak (0: not at all)

    def __post_init__(self) -> None:
        _require(self.max_workers >= 1, "max_workers", self.max_workers, "must be >= 1")
        _require(self.min_workers >= 0, "min_workers", self.min_workers, "must be >= 0")
        _require(self.min_workers <= self.max_workers, "min_workers", self.min_workers, "must be <= max_workers")
        _require(self.min_standby >= 0, "min_standby", self.min_standby, "must be >= 0")
        _require(0 < self.ttft_fraction <= 1, "ttft_fraction", self.ttft_fraction, "must be in (0, 1]")
        _require(0 < self.quiet_fraction < self.ttft_fraction, "quiet_fraction", self.quiet_fraction,
                 "must be in (0, ttft_fraction)")  # fmt: skip
        _require(self.scale_down_delay_s >= 0, "scale_down_delay_s", self.scale_down_delay_s, "must be >= 0")
        _require(self.scale_up_cooldown_s >= 0, "scale_up_cooldown_s", self.scale_up_cooldown_s, "must be >= 0")
        _require(self.forecast_window_s > 0, "forecast_window_s", self.forecast_window_s, "must be > 0")
        _require(self.forecast_history_s >= 2 * self.forecast_window_s, "forecast_history_s",
                 self.forecast_history_s, "must be >= 2 * forecast_window_s")  # fmt: skip
        _require(0 <= self.headroom < math.inf, "headroom", self.headroom, "must be a finite number >= 0")
        _require(self.peak_rps >= 0, "peak_rps", self.peak_rps, "must be >= 0")
        _require(self.peak_memory_s >= 0, "peak_memory_s", self.peak_memory_s, "must be >= 0")


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {rule}, got {value!r}")


@dataclass(slots=True)
class AutoscaleState:
    """What the fast loop remembers between ticks."""

    quiet_since: float | None = None
    last_change_at: float = -math.inf
    reserve: int = 0  # warm workers (serving, starting or standby) held for the peak
    smaller_reserve_since: float | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int  # workers serving or starting toward serving
    direction: Direction
    reason: str


def decide(snapshot: LoadSnapshot, policy: AutoscalePolicy, state: AutoscaleState, floor: int = 0,
           peak_fleet: int | None = None) -> Decision:  # fmt: skip
    """The fast loop: one decision for one model; `floor` is the slow loop's forecast floor, `peak_fleet` the
    warm workers a declared peak needs (peak_fleet; None without one): beyond it no worker is cold-started for a
    TTFT overshoot, nor the forecast floor raised, since that fleet held warm throughout meets the target."""
    current = len(snapshot.workers) + snapshot.num_starting
    decision = _fast(snapshot, policy, state, current, peak_fleet)
    ceiling = policy.max_workers if peak_fleet is None else max(peak_fleet, current)
    lower = max(policy.min_workers, min(floor, ceiling))
    if decision.desired < lower:
        reason = "forecast" if floor > policy.min_workers else "floor"
        decision = Decision(lower, "up" if lower > current else "hold", reason)
    if decision.desired != current:
        state.last_change_at = snapshot.now
        state.quiet_since = None
    return decision


def _fast(snapshot: LoadSnapshot, policy: AutoscalePolicy, state: AutoscaleState, current: int,
          peak_fleet: int | None) -> Decision:  # fmt: skip
    if current > policy.max_workers:  # the ceiling was lowered under us
        return Decision(policy.max_workers, "down", "ceiling")
    target = snapshot.ttft_target_s
    effective = snapshot.effective_ttft_s
    free = sum(w.free_slots for w in snapshot.workers)
    over_ttft = effective > policy.ttft_fraction * target
    over_queue = snapshot.queue_depth > free
    if over_ttft or over_queue:
        state.quiet_since = None
        reason = "ttft" if over_ttft else "queue"
        if current >= policy.max_workers:
            return Decision(current, "hold", "ceiling")
        if snapshot.num_standby > 0:  # a promotion is a routing flip: it shows in the next tick's indicators
            return Decision(min(policy.max_workers, current + _workers_short(snapshot, policy)), "up", reason)
        if peak_fleet is not None and current >= peak_fleet and not over_queue:
            # The peak's fleet serves: a cold start would cost more than holding it, and come a warm-up late. A queue
            # past the free slots is a load beyond the peak, which nothing sized, and starts one all the same.
            return Decision(current, "hold", "peak_fleet")
        if snapshot.num_starting > 0:
            return Decision(current, "hold", "starting")  # one action in flight
        if snapshot.now - state.last_change_at < policy.scale_up_cooldown_s:
            return Decision(current, "hold", "cooldown")
        return Decision(min(policy.max_workers, current + _workers_short(snapshot, policy)), "up", reason)
    if not _quiet(snapshot, policy, effective):
        state.quiet_since = None
        return Decision(current, "hold", "steady")
    if state.quiet_since is None:
        state.quiet_since = snapshot.now
    if current <= policy.min_workers:
        return Decision(current, "hold", "floor")
    if snapshot.num_starting > 0:
        return Decision(current, "hold", "starting")
    if snapshot.now - state.quiet_since < policy.scale_down_delay_s:
        return Decision(current, "hold", "quiet_wait")
    return Decision(current - 1, "down", "quiet")


def _workers_short(snapshot: LoadSnapshot, policy: AutoscalePolicy) -> int:
    """How many workers to add at once: one for a TTFT overshoot (the forecast floor sizes sustained load), or as
    many as would hold the queue beyond the free slots."""
    slots = max((w.max_num_seqs for w in snapshot.workers), default=1)
    free = sum(w.free_slots for w in snapshot.workers)
    return max(1, math.ceil(max(0, snapshot.queue_depth - free) / slots))


def _quiet(snapshot: LoadSnapshot, policy: AutoscalePolicy, effective: float) -> bool:
    """Quiet: TTFT well under target, nothing queued, and one worker fewer could hold what runs now."""
    if snapshot.queue_depth or effective > policy.quiet_fraction * snapshot.ttft_target_s:
        return False
    in_flight = sum(w.num_running + w.num_waiting for w in snapshot.workers)
    slots = sorted(w.max_num_seqs for w in snapshot.workers)
    return in_flight <= sum(slots[:-1])  # the smallest workers stay


@dataclass(frozen=True, slots=True)
class StepCost:
    """A step's milliseconds as base_ms + per_token_ms * tokens computed in the step: the frontend's fit from the
    workers' load reports (not gpu_runtime.latency.StepTimeModel, the scheduler's own fit of each step)."""

    base_ms: float
    per_token_ms: float

    def step_ms(self, tokens: int) -> float:
        return self.base_ms + self.per_token_ms * tokens


def fit_step_model(samples: list[tuple[int, float]], skip_first: int = 0) -> StepCost:
    """Least squares over (tokens in step, step ms) samples, the first `skip_first` (cold-start steps: allocator
    warm-up, kernel compilation) left out so that they do not inflate the costs."""
    kept = samples[skip_first:]
    if len(kept) < 2:
        raise ValueError(f"samples: need >= 2 after skip_first={skip_first}, got {len(kept)}")
    n = len(kept)
    mean_x = sum(t for t, _ in kept) / n
    mean_y = sum(ms for _, ms in kept) / n
    sxx = sum((t - mean_x) ** 2 for t, _ in kept)
    if sxx == 0:
        raise ValueError("samples: every step computed the same number of tokens; the slope is undetermined")
    slope = sum((t - mean_x) * (ms - mean_y) for t, ms in kept) / sxx
    slope = max(0.0, slope)  # a cost cannot be negative: that is noise
    return StepCost(base_ms=max(0.0, mean_y - slope * mean_x), per_token_ms=slope)


@dataclass(frozen=True, slots=True)
class WorkerCapacity:
    requests_per_s: float
    depth: int  # running sequences at which it is reached
    ttft_s: float  # the prefill time of a mean prompt at that depth


def worker_capacity(
    step_model: StepCost,
    prompt_tokens: float,
    output_tokens: float,
    ttft_target_s: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> WorkerCapacity:
    """A worker's request throughput at the batch depth that keeps a mean prompt's prefill under the TTFT target.

    At depth d (sequences decoding) each step computes d decode tokens plus the prefill that keeps pace with them,
    d * prompt / output tokens, up to the token budget; requests then finish at (step tokens - d) / prompt per step.
    A new prompt's prefill shares full-budget steps with the d decodes: ceil(prompt / (budget - d)) of them.
    """
    budget = max_num_batched_tokens
    prompt, output = max(1.0, prompt_tokens), max(1.0, output_tokens)
    full_step_s = step_model.step_ms(budget) / 1e3
    best = WorkerCapacity(0.0, 0, math.inf)
    for depth in range(1, min(max_num_seqs, budget - 1) + 1):
        ttft = math.ceil(prompt / (budget - depth)) * full_step_s
        if ttft > ttft_target_s and best.depth:
            break
        tokens = min(budget, depth * (1 + prompt / output))
        rate = (tokens - depth) / prompt / (step_model.step_ms(round(tokens)) / 1e3)
        if rate > best.requests_per_s:
            best = WorkerCapacity(rate, depth, ttft)
    return best


@dataclass(frozen=True, slots=True)
class Forecast:
    rate: float  # requests per second expected at the horizon
    prompt_tokens: float
    output_tokens: float


def forecast_load(
    arrivals: list[tuple[float, int, int]], now: float, horizon_s: float, policy: AutoscalePolicy
) -> Forecast:
    """A linear trend over the arrival rate of recent windows, extrapolated to now + horizon but never further ahead
    than the history it was fitted on, and never below the last window's rate (so a falling trend does not release
    workers before the fast loop sees the load quiet)."""
    width = policy.forecast_window_s
    count = int(policy.forecast_history_s // width)
    recent = [a for a in arrivals if now - count * width <= a[0] <= now]
    if not recent:
        return Forecast(0.0, 0.0, 0.0)
    rates = [0.0] * count
    for t, _, _ in recent:
        rates[min(count - 1, int((t - (now - count * width)) // width))] += 1 / width
    xs = [now - (count - i - 0.5) * width for i in range(count)]  # window midpoints
    mean_x, mean_y = sum(xs) / count, sum(rates) / count
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, rates, strict=True))
    slope /= sum((x - mean_x) ** 2 for x in xs)
    trend = mean_y + slope * (now + min(horizon_s, policy.forecast_history_s) - mean_x)
    prompt = sum(a[1] for a in recent) / len(recent)
    output = sum(a[2] for a in recent) / len(recent)
    if policy.peak_rps > 0:  # the operator's peak bounds what a trend may be extrapolated to
        trend = min(trend, policy.peak_rps)
    return Forecast(max(trend, rates[-1], 0.0), prompt, output)


def forecast_floor(
    arrivals: list[tuple[float, int, int]],
    now: float,
    horizon_s: float,
    step_model: StepCost,
    policy: AutoscalePolicy,
    *,
    ttft_target_s: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> int:
    """The slow loop: the workers the forecast load needs at now + horizon (the measured warm-up time), within
    [min_workers, max_workers]. `arrivals` are (time, prompt_tokens, output_tokens)."""
    forecast = forecast_load(arrivals, now, horizon_s, policy)
    if forecast.rate <= 0:
        return policy.min_workers
    target = policy.ttft_fraction * ttft_target_s
    capacity = worker_capacity(step_model, forecast.prompt_tokens, forecast.output_tokens, target, max_num_seqs,
                               max_num_batched_tokens)  # fmt: skip
    if capacity.requests_per_s <= 0:
        return policy.max_workers
    return max(policy.min_workers, fleet_size(forecast.rate, capacity.requests_per_s, policy))


def fleet_size(rate_rps: float, capacity_rps: float, policy: AutoscalePolicy) -> int:
    """The fewest workers that serve `rate_rps` within the TTFT target, each of `capacity_rps` (worker_capacity),
    at most max_workers: the offered workers a = rate / capacity, plus headroom * sqrt(a) for what variance takes
    (square-root staffing, as call centres size their agents: the share lost shrinks as the fleet grows). It is
    the cheapest fixed fleet for a peak that lasts; a shorter peak may be served by fewer."""
    if rate_rps <= 0:
        return 0
    if capacity_rps <= 0:
        return policy.max_workers
    offered = rate_rps / capacity_rps
    return min(policy.max_workers, math.ceil(offered + policy.headroom * math.sqrt(offered) - 1e-9))


def peak_rate(window_counts: Mapping[int, int], now: float, policy: AutoscalePolicy) -> float:
    """The highest arrival rate expected: the operator's `peak_rps`, or the busiest forecast window of the last
    `peak_memory_s` if that was busier (a peak seen once is expected again: daily cycles, recurring bursts).
    `window_counts` maps a window's index (arrival time // forecast_window_s) to the arrivals in it.

    The busiest of many windows is the one whose count chance raised most: a Poisson count of n varies by sqrt(n),
    so the busiest is taken at one deviation less (n - sqrt(n)), the rate it shows with that chance taken off (at a
    steady 8 req/s the busiest of 24 windows of 30 s counts about 270, or 9 req/s: one worker too many at peak)."""
    width = policy.forecast_window_s
    oldest = (now - policy.peak_memory_s) // width
    busiest = max((n for index, n in window_counts.items() if index >= oldest), default=0)
    return max(policy.peak_rps, (busiest - math.sqrt(busiest)) / width)


def standby_target(reserve: int, active: int, now: float, policy: AutoscalePolicy, state: AutoscaleState) -> int:
    """Warm standbys to keep beside `active` workers (serving or starting toward it): enough that a rise to the
    peak is served by promotions (routing flips) instead of cold starts, which take the whole warm-up time; never
    fewer than min_standby (the operator's, beside whatever serves). The reserve (serving and standby together) grows
    at once and shrinks by one worker each scale_down_delay_s that it wants less, as the fast loop drains: a warm
    worker let go costs a warm-up to get back.

    A step to the peak cannot be forecast, and a worker started when it comes serves only a warm-up later: every
    request in between waits. Warm capacity is what serves it, at the cost of holding it while the load is low:
    the cheapest fixed fleet for the peak (`reserve`: peak_fleet, 0 without one), never more, so that autoscaling
    never costs more than provisioning for the peak."""
    if reserve >= state.reserve:
        state.reserve, state.smaller_reserve_since = reserve, None
    elif state.smaller_reserve_since is None:
        state.smaller_reserve_since = now
    elif now - state.smaller_reserve_since >= policy.scale_down_delay_s:
        state.reserve -= 1  # one at a time, as the fast loop drains: request sizes and so capacities wobble
        state.smaller_reserve_since = now if state.reserve > reserve else None
    return max(policy.min_standby, state.reserve - active)


def peak_fleet(peak_rps: float, capacity_rps: float, policy: AutoscalePolicy) -> int | None:
    """The warm workers the peak needs: fleet_size, or every worker the ceiling allows for a declared peak before
    a step time is measured to size it; None with no peak, or a peak only seen and no capacity yet."""
    if peak_rps <= 0:
        return None
    if capacity_rps <= 0:
        return policy.max_workers if policy.peak_rps > 0 else None
    return max(policy.min_workers, fleet_size(peak_rps, capacity_rps, policy))
