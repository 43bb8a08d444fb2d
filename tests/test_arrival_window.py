"""frontend.arrival_window against the full scan it replaces: on a random trace (arrivals that finish out of order,
prompts either side of the prefill threshold), every tick's forecast, floor, capacity and pool share are the old
code's, for the routed and the prefill pool, while a tick reads per-second counts instead of every arrival."""

from __future__ import annotations

import random

import pytest

from common.autoscale_policy import AutoscalePolicy, StepCost, forecast_floor, forecast_load, worker_capacity
from frontend.arrival_window import ArrivalWindow
from frontend.autoscale_decision import PoolView, Sizing, _capacity_rps, _forecast_floor, forecast_of
from frontend.autoscale_inputs import AutoscaleInputs

pytestmark = pytest.mark.fast

HISTORY_S, WIDTH_S, MIN_LONG = 300.0, 30.0, 64
POLICY = AutoscalePolicy(max_workers=16, forecast_window_s=WIDTH_S, forecast_history_s=HISTORY_S)
SIZING = Sizing(StepCost(4.0, 0.05), 32, 2048)
TARGET_S = 2.0


def _old_pool_arrivals(arrivals, prefill):
    """The full scan as it was (frontend.autoscale_decision.pool_arrivals)."""
    if not prefill:
        return arrivals, 1.0
    long = [(arrived, prompt, 1) for arrived, prompt, _ in arrivals if prompt >= MIN_LONG]
    return long, len(long) / len(arrivals) if arrivals else 1.0


def _old_capacity(arrivals):
    if not arrivals:
        return 0.0
    prompt = sum(a[1] for a in arrivals) / len(arrivals)
    output = sum(a[2] for a in arrivals) / len(arrivals)
    return worker_capacity(SIZING.step_cost, prompt, output, POLICY.ttft_fraction * TARGET_S, SIZING.max_num_seqs,
                           SIZING.max_num_batched_tokens).requests_per_s  # fmt: skip


def _trace(seed: int, seconds: float) -> list[tuple[float, float, int, int]]:
    """(finished, arrived, prompt, output): a rate rising from 1 to 9 req/s, each request lasting up to 20 s."""
    rng, t, trace = random.Random(seed), 0.0, []
    while t < seconds:
        t += rng.expovariate(1.0 + 8.0 * t / seconds)
        trace.append((t + rng.uniform(0, 20), t, rng.choice([8, 40, 63, 64, 200, 900]), rng.randint(1, 300)))
    return sorted(trace)


@pytest.mark.parametrize("seed", [1, 2])
def test_every_tick_reads_what_the_full_scan_read(seed):
    inputs = AutoscaleInputs(HISTORY_S, WIDTH_S, 3600.0, MIN_LONG)
    trace, fed = _trace(seed, 600.0), 0
    for tick in range(3, 641, 3):
        now = float(tick)
        while fed < len(trace) and trace[fed][0] <= now:  # requests are counted as they finish
            inputs.request_finished("m", *trace[fed][1:])
            fed += 1
        window = inputs.window("m")
        newest = max((arrived for _, arrived, _, _ in trace[:fed]), default=0.0)
        kept = sorted(a[1:] for a in trace[:fed] if a[1] >= newest - HISTORY_S)
        assert list(window) == kept == inputs.arrivals("m")
        view = PoolView(now, [], 0, 0.0, 0, 0, window, {}, SIZING, 60.0)
        for prefill in (False, True):
            arrivals, share = _old_pool_arrivals(kept, prefill)
            seen = window.pool(now, int(HISTORY_S // WIDTH_S), WIDTH_S, prefill)
            old, new = forecast_load(arrivals, now, 60.0, POLICY), forecast_of(seen, now, 60.0, POLICY)
            assert (new.rate, new.prompt_tokens, new.output_tokens) == pytest.approx(
                (old.rate, old.prompt_tokens, old.output_tokens), rel=1e-9, abs=1e-12
            )
            old_floor = forecast_floor(arrivals, now, 60.0, SIZING.step_cost, POLICY, ttft_target_s=TARGET_S,
                                       max_num_seqs=SIZING.max_num_seqs,
                                       max_num_batched_tokens=SIZING.max_num_batched_tokens)  # fmt: skip
            assert _forecast_floor(view, seen, TARGET_S, POLICY) == old_floor, (now, prefill)
            capacity = _capacity_rps(SIZING, seen, POLICY.ttft_fraction * TARGET_S)
            assert capacity == pytest.approx(_old_capacity(arrivals), rel=1e-12)
            assert seen.share == share


def test_a_list_of_arrivals_decides_as_the_window_does():
    trace = [(t, p, o) for _, t, p, o in _trace(4, 200.0)]
    window = ArrivalWindow.of(trace, min_long_prompt=MIN_LONG)
    assert len(window) == len(trace) and list(window) == sorted(trace)
    backwards = ArrivalWindow.of(reversed(trace), min_long_prompt=MIN_LONG)  # late finishers, all of them
    for prefill in (False, True):
        assert window.pool(200.0, 10, WIDTH_S, prefill) == backwards.pool(200.0, 10, WIDTH_S, prefill)


def test_an_empty_window_forecasts_nothing_and_counts_every_request_as_long():
    seen = ArrivalWindow(HISTORY_S, MIN_LONG).pool(100.0, 10, WIDTH_S, True)
    assert (seen.num_recent, seen.num_kept, seen.share) == (0, 0, 1.0)
    assert forecast_of(seen, 100.0, 60.0, POLICY).rate == 0.0
