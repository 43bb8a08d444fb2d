"""The autoscaler's policy (common/autoscale_policy.py): when the fast loop scales up, holds and scales down, the
floor and ceiling, the step-time fit that leaves cold-start steps out, the forecast floor following a trend, and the
standbys held warm for the peak."""

from __future__ import annotations

import random

import pytest

from common.autoscale_policy import (
    AutoscalePolicy,
    AutoscaleState,
    LoadSnapshot,
    StepCost,
    WorkerSnapshot,
    decide,
    fit_step_model,
    fleet_size,
    forecast_floor,
    forecast_load,
    peak_fleet,
    peak_rate,
    standby_target,
    worker_capacity,
)

TARGET = 1.0


def worker(ttft: float = 0.1, running: int = 4, waiting: int = 0, slots: int = 32) -> WorkerSnapshot:
    return WorkerSnapshot(projected_ttft_s=ttft, num_running=running, num_waiting=waiting, max_num_seqs=slots)


def load(now: float, workers, queue: int = 0, wait: float = 0.0, starting: int = 0, standby: int = 0) -> LoadSnapshot:
    return LoadSnapshot(now=now, workers=list(workers), queue_depth=queue, queue_wait_s=wait, ttft_target_s=TARGET,
                        num_standby=standby, num_starting=starting)  # fmt: skip


POLICY = AutoscalePolicy(max_workers=4, scale_down_delay_s=60.0)


def test_scales_up_when_projected_ttft_plus_queue_wait_passes_the_fraction_of_the_target():
    # Projected 0.5 s alone is under 0.8 * 1 s; with 0.4 s of queue wait the effective TTFT is 0.9 s.
    assert decide(load(0, [worker(0.5)], queue=1, wait=0.0), POLICY, AutoscaleState()).direction == "hold"
    decision = decide(load(0, [worker(0.5)], queue=1, wait=0.4), POLICY, AutoscaleState())
    assert decision == decision.__class__(desired=2, direction="up", reason="ttft")


def test_the_best_worker_decides_the_effective_ttft():
    decision = decide(load(0, [worker(5.0), worker(0.2)]), POLICY, AutoscaleState())
    assert decision.direction == "hold"


def test_scales_up_when_the_queue_passes_the_free_slots_sized_to_hold_it():
    busy = worker(0.1, running=30)  # two free slots
    decision = decide(load(0, [busy], queue=40), POLICY, AutoscaleState())
    assert (decision.direction, decision.reason) == ("up", "queue")
    assert decision.desired == 1 + 2  # 38 requests beyond the free slots need two more 32-slot workers


def test_holds_while_a_worker_is_starting_then_acts_again_once_it_serves():
    state = AutoscaleState()
    first = decide(load(0, [worker(0.95)]), POLICY, state)
    assert first.desired == 2
    during = decide(load(10, [worker(0.95)], starting=1), POLICY, state)
    assert (during.desired, during.direction, during.reason) == (2, "hold", "starting")
    after = decide(load(20, [worker(0.95), worker(0.95)]), POLICY, state)
    assert (after.desired, after.direction) == (3, "up")


def test_a_warm_standby_is_promoted_every_tick_the_overshoot_lasts_without_waiting_out_a_cooldown():
    # A promotion is a routing flip whose effect the next tick sees; a cold start is not, so it waits.
    state = AutoscaleState()
    assert decide(load(0, [worker(0.95)], standby=2), POLICY, state).desired == 2
    again = decide(load(1, [worker(0.95), worker(0.95)], starting=0, standby=1), POLICY, state)
    assert (again.desired, again.direction, again.reason) == (3, "up", "ttft")
    cold = decide(load(2, [worker(0.95)] * 3, starting=0, standby=0), POLICY, state)
    assert (cold.direction, cold.reason) == ("hold", "cooldown")


def test_scales_down_one_worker_only_after_the_quiet_delay():
    state = AutoscaleState()
    quiet = [worker(0.1, running=2), worker(0.1, running=2), worker(0.1, running=1)]
    for now in range(0, 60, 5):
        assert decide(load(now, quiet), POLICY, state).direction == "hold"
    decision = decide(load(60, quiet), POLICY, state)
    assert (decision.desired, decision.direction, decision.reason) == (2, "down", "quiet")
    # The next step down waits a whole delay again.
    assert decide(load(61, quiet[:2]), POLICY, state).direction == "hold"
    assert decide(load(121, quiet[:2]), POLICY, state).direction == "down"


def test_a_busy_moment_restarts_the_quiet_delay():
    state = AutoscaleState()
    quiet = [worker(0.1), worker(0.1)]
    decide(load(0, quiet), POLICY, state)
    decide(load(50, [worker(0.6), worker(0.6)]), POLICY, state)  # not quiet: 0.6 > 0.4 * target
    assert decide(load(70, quiet), POLICY, state).direction == "hold"
    assert decide(load(130, quiet), POLICY, state).direction == "down"


def test_no_scale_down_when_one_worker_fewer_could_not_hold_the_running_requests():
    state = AutoscaleState()
    full = [worker(0.1, running=20), worker(0.1, running=20)]  # 40 running > 32 slots of one worker
    for now in (0, 100, 200):
        assert decide(load(now, full), POLICY, state).direction == "hold"


def test_never_below_the_floor_nor_above_the_ceiling():
    state = AutoscaleState()
    policy = AutoscalePolicy(max_workers=2, min_workers=2, scale_down_delay_s=0)
    quiet = decide(load(100, [worker(0.0, running=0), worker(0.0, running=0)]), policy, state)
    assert (quiet.desired, quiet.direction, quiet.reason) == (2, "hold", "floor")
    hot = decide(load(200, [worker(3.0), worker(3.0)], queue=500, wait=5), policy, state)
    assert (hot.desired, hot.direction, hot.reason) == (2, "hold", "ceiling")
    below = decide(load(300, [worker(0.1)]), policy, AutoscaleState())
    assert (below.desired, below.direction, below.reason) == (2, "up", "floor")


def test_the_forecast_floor_raises_desired_and_holds_off_scale_down():
    state = AutoscaleState()
    decision = decide(load(0, [worker(0.1)]), POLICY, state, floor=3)
    assert (decision.desired, decision.direction, decision.reason) == (3, "up", "forecast")
    quiet = [worker(0.0, running=0)] * 3
    for now in (100, 200, 300):
        assert decide(load(now, quiet), POLICY, state, floor=3).desired == 3
    assert decide(load(400, quiet), POLICY, state, floor=9).desired == POLICY.max_workers


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_workers": 0}, "max_workers"),
        ({"max_workers": 2, "min_workers": 3}, "min_workers"),
        ({"max_workers": 2, "ttft_fraction": 1.5}, "ttft_fraction"),
        ({"max_workers": 2, "min_standby": -1}, "min_standby"),
        ({"max_workers": 2, "scale_down_delay_s": -1}, "scale_down_delay_s"),
        ({"max_workers": 2, "peak_rps": -1.0}, "peak_rps"),
        ({"max_workers": 2, "peak_memory_s": -5.0}, "peak_memory_s"),
        ({"max_workers": 2, "headroom": -0.1}, "headroom"),
        ({"max_workers": 2, "headroom": float("inf")}, "headroom"),
    ],
)
def test_a_bad_setting_is_refused_naming_its_field(options, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        AutoscalePolicy(**options)


def _samples(model: StepCost, n: int, rng: random.Random) -> list[tuple[int, float]]:
    out = []
    for _ in range(n):
        tokens = rng.randrange(1, 1024)
        out.append((tokens, model.step_ms(tokens) * rng.uniform(0.97, 1.03)))
    return out


def test_the_step_model_fit_recovers_known_coefficients_and_leaves_cold_steps_out():
    rng = random.Random(0)
    truth = StepCost(base_ms=12.0, per_token_ms=0.35)
    cold = [(4000, 1400.0), (24, 300.0), (24, 310.0), (24, 290.0)]  # allocator and kernel warm-up
    samples = cold + _samples(truth, 400, rng)
    fitted = fit_step_model(samples, skip_first=len(cold))
    assert fitted.base_ms == pytest.approx(truth.base_ms, rel=0.1)
    assert fitted.per_token_ms == pytest.approx(truth.per_token_ms, rel=0.02)
    skewed = fit_step_model(samples)  # what the cold steps do to a fit that keeps them
    assert abs(skewed.base_ms - truth.base_ms) > 2 * abs(fitted.base_ms - truth.base_ms)


def _arrivals(rate_at, seconds: float, rng: random.Random) -> list[tuple[float, int, int]]:
    out, t = [], 0.0
    while t < seconds:
        t += rng.expovariate(8.0)
        if rng.random() * 8.0 < rate_at(t):
            out.append((t, 1024, 256))
    return out


def test_the_forecast_rises_with_a_rising_trend():
    policy = AutoscalePolicy(max_workers=16)
    model = StepCost(base_ms=11.0, per_token_ms=0.36)
    flat = _arrivals(lambda t: 3.0, 300, random.Random(1))
    rising = _arrivals(lambda t: 1.0 + 4.0 * t / 300, 300, random.Random(1))  # 3 req/s on average, 5 at the end
    assert forecast_load(rising, 300, 120, policy).rate > forecast_load(flat, 300, 120, policy).rate + 1.5
    shape = {"ttft_target_s": 2.0, "max_num_seqs": 32, "max_num_batched_tokens": 512}
    flat_floor = forecast_floor(flat, 300, 120, model, policy, **shape)
    assert forecast_floor(rising, 300, 120, model, policy, **shape) > flat_floor
    assert forecast_floor(rising, 300, 300, model, policy, **shape) >= forecast_floor(rising, 300, 30, model, policy,
                                                                                    **shape)  # fmt: skip
    assert forecast_floor([], 300, 120, model, policy, **shape) == policy.min_workers


def test_a_declared_peak_bounds_the_trend_but_not_the_load_already_seen():
    steep = _arrivals(lambda t: 1.0 + 5.0 * t / 300, 300, random.Random(2))  # 6 req/s at the end, rising fast
    free = forecast_load(steep, 300, 300, AutoscalePolicy(max_workers=16)).rate
    bounded = forecast_load(steep, 300, 300, AutoscalePolicy(max_workers=16, peak_rps=7.0)).rate
    assert free > 8.0 and bounded == 7.0  # extrapolated past the peak only when none is declared
    low_peak = forecast_load(steep, 300, 300, AutoscalePolicy(max_workers=16, peak_rps=2.0)).rate
    assert low_peak >= 5.0  # a load already above the declared peak is still planned for


def test_worker_capacity_keeps_the_prefill_under_the_target():
    model = StepCost(base_ms=11.0, per_token_ms=0.36)
    loose = worker_capacity(model, 1024, 256, ttft_target_s=2.0, max_num_seqs=32, max_num_batched_tokens=512)
    tight = worker_capacity(model, 1024, 256, ttft_target_s=0.5, max_num_seqs=32, max_num_batched_tokens=512)
    assert loose.ttft_s <= 2.0 and loose.requests_per_s > 0
    assert tight.requests_per_s <= loose.requests_per_s


def test_the_peak_is_the_declared_rate_or_the_busiest_remembered_window_whichever_is_higher():
    policy = AutoscalePolicy(max_workers=8, peak_rps=2.0, peak_memory_s=600.0, forecast_window_s=30.0)
    counts = {0: 300, 10: 30, 30: 90}  # windows at 0 s (10 req/s), 300 s (1 req/s) and 900 s (3 req/s)
    # The busiest window is taken at one Poisson deviation less: (300 - sqrt(300)) / 30 s.
    assert peak_rate(counts, now=550.0, policy=policy) == pytest.approx(9.423, abs=1e-3)  # still remembered
    assert peak_rate(counts, now=920.0, policy=policy) == pytest.approx(2.684, abs=1e-3)  # 600 s later: forgotten
    assert peak_rate({}, now=0.0, policy=policy) == 2.0  # nothing seen yet: the declared peak
    assert peak_rate({30: 64}, now=920.0, policy=policy) == 2.0  # (64 - 8) / 30 s: under the declared peak
    forgetful = AutoscalePolicy(max_workers=8, peak_memory_s=0.0, forecast_window_s=30.0)
    assert peak_rate(counts, now=920.0, policy=forgetful) == pytest.approx(2.684, abs=1e-3)  # the current window


def test_a_steady_peak_seen_in_many_windows_is_not_raised_by_the_busiest_ones_chance():
    rng = random.Random(7)
    policy = AutoscalePolicy(max_workers=16, forecast_window_s=30.0)
    counts = {}
    for window in range(24):  # 12 minutes at a steady 8 req/s
        arrivals, t = 0, rng.expovariate(8.0)
        while t < 30.0:
            arrivals, t = arrivals + 1, t + rng.expovariate(8.0)
        counts[window] = arrivals
    busiest = max(counts.values()) / 30.0
    peak = peak_rate(counts, now=24 * 30.0, policy=policy)
    assert 8.0 <= peak < busiest
    # At 1.413 req/s a worker (the simulated requests), 8 req/s needs 7 workers; the busiest window alone asks 8.
    assert fleet_size(peak, 1.413, policy) == fleet_size(8.0, 1.413, policy) == 7
    assert fleet_size(busiest, 1.413, policy) == 8


def test_the_fleet_for_a_rate_is_its_offered_workers_plus_headroom_times_their_square_root():
    policy = AutoscalePolicy(max_workers=12)  # headroom 0.2
    # 8 req/s at 1.413 req/s a worker: a = 5.662 offered workers, + 0.2 * sqrt(5.662) = 6.138: 7 workers.
    assert fleet_size(8.0, 1.413, policy) == 7
    assert fleet_size(8.0, 1.413, AutoscalePolicy(max_workers=12, headroom=0.0)) == 6  # a alone, rounded up
    assert fleet_size(8.0, 2.0, AutoscalePolicy(max_workers=12, headroom=0.0)) == 4  # exactly 4: not 5
    # 8 req/s at 2: a = 4, + 0.2 * 2 = 4.4: 5. At 100 req/s at 2: 50 + 0.2 * 7.07 = 51.4, past the ceiling.
    assert fleet_size(8.0, 2.0, policy) == 5
    assert fleet_size(100.0, 2.0, policy) == 12
    assert fleet_size(0.0, 2.0, policy) == 0  # no load, no fleet
    assert fleet_size(8.0, 0.0, policy) == 12  # no capacity to size it: all the ceiling allows
    # The share of its capacity a fleet may use grows with it (pooling): 4 workers take 3.62 offered workers (90 %),
    # 9 workers 8.42 (94 %).
    assert fleet_size(3.60 * 2.0, 2.0, policy) == 4 and fleet_size(3.65 * 2.0, 2.0, policy) == 5
    assert fleet_size(8.40 * 2.0, 2.0, policy) == 9 and fleet_size(8.45 * 2.0, 2.0, policy) == 10


def test_the_peak_fleet_is_sized_when_the_peak_and_a_capacity_are_known():
    declared = AutoscalePolicy(max_workers=10, min_workers=2, peak_rps=8.0)
    assert peak_fleet(8.0, 2.0, declared) == 5
    assert peak_fleet(1.0, 2.0, declared) == 2  # never under min_workers
    assert peak_fleet(8.0, 0.0, declared) == 10  # declared, not sized yet: every worker the ceiling allows
    seen = AutoscalePolicy(max_workers=10)
    assert peak_fleet(8.0, 0.0, seen) is None  # only seen: it waits for a capacity to size it
    assert peak_fleet(0.0, 2.0, seen) is None


def test_with_the_peak_fleet_warm_a_ttft_overshoot_starts_no_worker_cold_but_a_queue_past_the_slots_does():
    policy = AutoscalePolicy(max_workers=10)
    hot = [worker(0.95)] * 3
    held = decide(load(0, hot), policy, AutoscaleState(), peak_fleet=3)
    assert (held.desired, held.direction, held.reason) == (3, "hold", "peak_fleet")
    # Below the fleet, or with no peak declared, it scales up as before.
    assert decide(load(0, hot), policy, AutoscaleState(), peak_fleet=4).direction == "up"
    assert decide(load(0, hot), policy, AutoscaleState()).direction == "up"
    # A warm standby is promoted whatever the fleet: it is paid for already.
    promoted = decide(load(0, hot, standby=1), policy, AutoscaleState(), peak_fleet=3)
    assert (promoted.desired, promoted.direction) == (4, "up")
    # A queue past every free slot is a load beyond the peak that was sized: a worker is started all the same.
    full = [worker(0.1, running=32)] * 3
    queued = decide(load(0, full, queue=10), policy, AutoscaleState(), peak_fleet=3)
    assert (queued.desired, queued.direction, queued.reason) == (4, "up", "queue")
    # The forecast floor is held to the fleet too.
    floored = decide(load(0, [worker(0.1)] * 3), policy, AutoscaleState(), floor=9, peak_fleet=5)
    assert (floored.desired, floored.reason) == (5, "forecast")


def _wanted(peak_rps: float, capacity_rps: float, policy: AutoscalePolicy) -> int:
    return peak_fleet(peak_rps, capacity_rps, policy) or 0


def test_standbys_hold_warm_capacity_for_the_peak_beside_the_serving_workers():
    policy = AutoscalePolicy(max_workers=10, min_standby=1)
    state = AutoscaleState()
    # 8 req/s at 2 req/s a worker: 4 offered workers + 0.2 * sqrt(4) = 4.4, so 5 warm; with 1 serving, 4 wait.
    assert standby_target(_wanted(8.0, 2.0, policy), active=1, now=0.0, policy=policy, state=state) == 4
    assert (
        standby_target(_wanted(8.0, 2.0, policy), active=4, now=1.0, policy=policy, state=state) == 1
    )  # promoted: fewer wait
    assert (
        standby_target(_wanted(8.0, 2.0, policy), active=6, now=2.0, policy=policy, state=state) == 1
    )  # never under min_standby
    assert (
        standby_target(_wanted(0.0, 2.0, policy), active=1, now=3.0, policy=policy, state=AutoscaleState()) == 1
    )  # no peak
    # A declared peak before any step time is measured: every worker the ceiling allows is held warm...
    declared = AutoscalePolicy(max_workers=10, min_standby=1, peak_rps=8.0)
    assert standby_target(_wanted(8.0, 0.0, declared), active=1, now=3.0, policy=declared, state=AutoscaleState()) == 9
    # ...a peak only seen waits for the capacity to size it.
    assert standby_target(_wanted(8.0, 0.0, policy), active=1, now=3.0, policy=policy, state=AutoscaleState()) == 1


def test_the_reserve_grows_at_once_and_shrinks_by_one_each_scale_down_delay():
    policy = AutoscalePolicy(max_workers=10, scale_down_delay_s=60.0, headroom=0.0)
    state = AutoscaleState()
    assert standby_target(_wanted(8.0, 2.0, policy), active=1, now=0.0, policy=policy, state=state) == 3
    # Request sizes wobble, so the capacity does: a smaller reserve waits out the delay, then goes one at a time...
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=10.0, policy=policy, state=state) == 3
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=69.0, policy=policy, state=state) == 3
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=70.0, policy=policy, state=state) == 2
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=129.0, policy=policy, state=state) == 2
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=130.0, policy=policy, state=state) == 1
    assert (
        standby_target(_wanted(4.0, 2.0, policy), active=1, now=500.0, policy=policy, state=state) == 1
    )  # at what it wants
    # ...a larger one is held at once, and a wobble back up resets the wait.
    assert standby_target(_wanted(12.0, 2.0, policy), active=1, now=501.0, policy=policy, state=state) == 5
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=510.0, policy=policy, state=state) == 5
    assert standby_target(_wanted(12.0, 2.0, policy), active=1, now=530.0, policy=policy, state=state) == 5
    assert standby_target(_wanted(4.0, 2.0, policy), active=1, now=589.0, policy=policy, state=state) == 5


def test_the_reserve_never_passes_the_ceiling():
    policy = AutoscalePolicy(max_workers=3, headroom=0.0)
    assert standby_target(_wanted(100.0, 1.0, policy), active=1, now=0.0, policy=policy, state=AutoscaleState()) == 2
