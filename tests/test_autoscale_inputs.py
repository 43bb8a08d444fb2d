"""frontend.autoscale_inputs: step-time samples read off consecutive load reports, and the arrivals kept for the
forecast, as the autoscaler's slow loop gets them."""

from __future__ import annotations

import pytest

from frontend.autoscale_inputs import AutoscaleInputs
from gpu_runtime.ipc.messages import LoadReport

BASE_MS, PER_TOKEN_MS = 4.0, 0.05


def report(incarnation: str, steps: int, tokens: int, total_ms: float) -> LoadReport:
    return LoadReport(
        worker_id="m/0", incarnation=incarnation, num_running=0, num_running_batch=0, num_waiting=0,
        kv_cache_usage=0.0, num_pages=1, num_used_pages=0, prefix_query_tokens=0, prefix_hit_tokens=0,
        num_preemptions=0, projected_ttft_seconds=0.0, mean_step_ms=total_ms / steps if steps else 0.0, sent_at=0.0,
        iteration_token_counts=[steps], iteration_tokens_sum=tokens,
    )  # fmt: skip


def test_the_step_model_is_fitted_from_the_steps_between_reports_and_skips_the_cold_ones():
    inputs = AutoscaleInputs(history_s=300, window_s=30, peak_memory_s=3600)
    steps = tokens = 0
    total_ms = 0.0
    for i in range(40):
        size = 1 + (i * 37) % 256  # steps of varied sizes, ten per report
        cold = 50.0 if i < 3 else 0.0  # the first reports' steps are slow (warm-up): left out
        steps, tokens, total_ms = steps + 10, tokens + 10 * size, total_ms + 10 * (BASE_MS + PER_TOKEN_MS * size + cold)
        inputs.load_reported("m", "m/0", report("a", steps, tokens, total_ms))
    model = inputs.step_model("m")
    assert model.base_ms == pytest.approx(BASE_MS, rel=1e-6)
    assert model.per_token_ms == pytest.approx(PER_TOKEN_MS, rel=1e-6)
    assert inputs.step_model("other") is None


def test_a_restarted_worker_starts_its_samples_over_and_old_arrivals_age_out():
    inputs = AutoscaleInputs(history_s=60, window_s=30, peak_memory_s=3600)
    inputs.load_reported("m", "m/0", report("a", 1000, 50_000, 10_000.0))
    inputs.load_reported("m", "m/0", report("b", 10, 500, 100.0))  # a new incarnation: no difference to take
    assert inputs.step_model("m") is None
    for t in (0.0, 30.0, 100.0):
        inputs.request_finished("m", t, 12, 34)
    assert inputs.arrivals("m") == [(100.0, 12, 34)]


def test_arrivals_are_counted_per_window_for_the_peak_and_forgotten_after_its_memory():
    inputs = AutoscaleInputs(history_s=60, window_s=30, peak_memory_s=120)
    for t in (1.0, 2.0, 3.0, 31.0):
        inputs.request_finished("m", t, 12, 34)
    assert inputs.window_counts("m") == {0: 3, 1: 1}
    inputs.request_finished("m", 200.0, 12, 34)
    assert inputs.window_counts("m") == {6: 1}  # 0-60 s is more than 120 s before the latest arrival
    assert inputs.window_counts("other") == {}
