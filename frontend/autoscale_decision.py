"""One pool's autoscaling decision at one tick, from what the frontend sees of it: the pure part of the autoscaler.

frontend.autoscaler gathers the inputs from the scheduler link, the admission queue and the load reports, and sends
the outcome to the daemon; scripts/autoscale_sim gathers them from its simulated cluster. Both call `decide_pool`,
so the simulator's results are those of the glue the frontend runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from common.autoscale_policy import (
    AutoscalePolicy,
    AutoscaleState,
    Decision,
    Forecast,
    LoadSnapshot,
    StepCost,
    WorkerSnapshot,
    decide,
    fleet_size,
    peak_fleet,
    peak_rate,
    standby_target,
    worker_capacity,
)
from frontend.arrival_window import ArrivalWindow, PoolArrivals

DEFAULT_WARMUP_S = 30.0  # the forecast's horizon until a worker's warm-up has been measured
# Request sizes averaged over fewer arrivals than this do not resize a reserve already held: at a log-normal sigma
# of 0.5 the mean of 20 is within about 12 % (one standard error), of 1 within 50 %.
MIN_ARRIVALS_TO_SIZE = 20

Arrival = tuple[float, int, int]  # (time, prompt tokens, output tokens)


class Verdict(NamedTuple):
    """A pool's latest decision and what it saw (Admin.GetLoad)."""

    decision: Decision
    snapshot: LoadSnapshot
    standby: int  # warm standbys wanted beside the serving workers
    peak_rps: float  # the peak they are held for


@dataclass(frozen=True, slots=True)
class Sizing:
    """What sizing a worker's capacity needs: the fitted step cost and a ready worker's limits."""

    step_cost: StepCost
    max_num_seqs: int
    max_num_batched_tokens: int  # its token budget per step


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool at one tick, as the frontend sees it."""

    now: float
    workers: list[WorkerSnapshot]  # the ready serving workers that reported their load
    queue_depth: int  # the frontend's queue (0 for a prefill pool: its requests wait in the routed pool's)
    queue_wait_s: float
    num_standby: int
    num_starting: int  # starting toward serving (a loading standby not counted)
    # The model's recent arrivals: its ArrivalWindow (the autoscaler's, kept incrementally), or a list of them.
    arrivals: ArrivalWindow | list[Arrival]
    window_counts: Mapping[int, int]  # the model's arrivals per forecast window (common.autoscale_policy.peak_rate)
    sizing: Sizing | None  # None until a step cost is fitted and a worker is ready
    warmup_s: float  # the longest measured warm-up of the model's workers; 0 until one is measured


def decide_pool(view: PoolView, prefill: bool, min_prefill_prompt: int, ttft_target_s: float,
                policy: AutoscalePolicy, state: AutoscaleState) -> Verdict:  # fmt: skip
    """The fast loop's decision over the slow loop's forecast floor, and the standbys for the peak."""
    snapshot = LoadSnapshot(now=view.now, workers=view.workers, queue_depth=view.queue_depth,
                            queue_wait_s=view.queue_wait_s, ttft_target_s=ttft_target_s,
                            num_standby=view.num_standby, num_starting=view.num_starting)  # fmt: skip
    window = view.arrivals
    if not isinstance(window, ArrivalWindow):  # a list (the simulator's): counted once here
        window = ArrivalWindow.of(window, min_long_prompt=min_prefill_prompt)
    width = policy.forecast_window_s
    seen = window.pool(view.now, int(policy.forecast_history_s // width), width, prefill)
    floor = _forecast_floor(view, seen, ttft_target_s, policy)
    # Before any arrival, every request is taken as a long one: a declared peak then holds prefill workers too.
    peak = peak_rate(view.window_counts, view.now, policy) * seen.share
    capacity = _capacity_rps(view.sizing, seen, policy.ttft_fraction * ttft_target_s)
    fleet = peak_fleet(peak, capacity, policy)
    if state.reserve and seen.num_kept < MIN_ARRIVALS_TO_SIZE:
        fleet = state.reserve  # a few requests' sizes are noise: the reserve held stands until there are more
    # The fleet a declared peak needs bounds the cold starts; a peak only seen may be passed by the next burst.
    decision = decide(snapshot, policy, state, floor, fleet if policy.peak_rps > 0 else None)
    standby = standby_target(fleet or 0, decision.desired, view.now, policy, state)
    return Verdict(decision, snapshot, standby, peak)


def _capacity_rps(sizing: Sizing | None, seen: PoolArrivals, target_s: float) -> float:
    """One worker's requests/s within the TTFT target for the recent request sizes, by the fitted step cost; 0
    until there is one (standby_target then holds min_standby, or all it may for a declared peak)."""
    if sizing is None or not seen.num_kept:
        return 0.0
    return worker_capacity(sizing.step_cost, seen.mean_prompt, seen.mean_output, target_s, sizing.max_num_seqs,
                           sizing.max_num_batched_tokens).requests_per_s  # fmt: skip


def forecast_of(seen: PoolArrivals, now: float, horizon_s: float, policy: AutoscalePolicy) -> Forecast:
    """common.autoscale_policy.forecast_load, from the window's counts instead of every arrival: a linear trend
    over the recent windows' rates, extrapolated to now + horizon (never further than the history), never below
    the last window's rate, bounded by a declared peak."""
    if not seen.num_recent:
        return Forecast(0.0, 0.0, 0.0)
    rates, width = seen.rates, policy.forecast_window_s
    count = len(rates)
    xs = [now - (count - i - 0.5) * width for i in range(count)]  # window midpoints
    mean_x, mean_y = sum(xs) / count, sum(rates) / count
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, rates, strict=True))
    slope /= sum((x - mean_x) ** 2 for x in xs)
    trend = mean_y + slope * (now + min(horizon_s, policy.forecast_history_s) - mean_x)
    if policy.peak_rps > 0:
        trend = min(trend, policy.peak_rps)
    return Forecast(max(trend, rates[-1], 0.0), seen.recent_prompt, seen.recent_output)


def _forecast_floor(view: PoolView, seen: PoolArrivals, ttft_target_s: float, policy: AutoscalePolicy) -> int:
    """The slow loop (common.autoscale_policy.forecast_floor over the window's counts): the workers the forecast
    arrivals need by the time a worker started now would serve (the measured warm-up), by the fitted step cost;
    0 until there is a step cost to size them."""
    if view.sizing is None:
        return 0
    sizing = view.sizing
    forecast = forecast_of(seen, view.now, view.warmup_s or DEFAULT_WARMUP_S, policy)
    if forecast.rate <= 0:
        return policy.min_workers
    capacity = worker_capacity(sizing.step_cost, forecast.prompt_tokens, forecast.output_tokens,
                               policy.ttft_fraction * ttft_target_s, sizing.max_num_seqs,
                               sizing.max_num_batched_tokens)  # fmt: skip
    return max(policy.min_workers, fleet_size(forecast.rate, capacity.requests_per_s, policy))
