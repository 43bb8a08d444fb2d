"""The step-time model, the budgets it implies, and the projected time-to-first-token API."""

from __future__ import annotations

import random

import pytest

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from gpu_runtime.engine_config import SchedulerConfig
from gpu_runtime.latency import LatencyPolicy, StepTimeModel


def trained_model(a=0.004, b=0.0005, c=0.001, steps=200, noise=0.0) -> StepTimeModel:
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(steps):
        seqs = rng.randint(1, 32)
        tokens = seqs + rng.choice([0, 0, 16, 64, 256])
        model.observe(tokens, seqs, a + b * tokens + c * seqs + rng.gauss(0, noise))
    return model


def test_step_time_model_recovers_a_linear_cost():
    model = trained_model()
    assert model.predict(100, 10) == pytest.approx(0.004 + 0.05 + 0.01, rel=1e-3)
    noisy = trained_model(noise=0.001)
    assert noisy.predict(300, 16) == pytest.approx(0.004 + 0.15 + 0.016, rel=0.05)


def test_token_budget_keeps_the_itl_target_and_always_advances_prefill():
    config = SchedulerConfig(itl_slo_ms=50, max_num_batched_tokens=4096, max_num_seqs=64)
    policy = LatencyPolicy(config, min_chunk=16)
    policy.model = trained_model()
    budget = policy.token_budget(num_seqs=10)
    assert policy.model.predict(budget, 10) <= 0.050 < policy.model.predict(budget + 2, 10)
    # A target no step can meet still leaves room for every decode plus one chunk of prefill.
    strict = LatencyPolicy(SchedulerConfig(itl_slo_ms=1, max_num_batched_tokens=4096, max_num_seqs=64), min_chunk=16)
    strict.model = policy.model
    assert strict.token_budget(num_seqs=10) == 10 + 16


def test_batch_depth_is_held_to_the_ttft_target():
    model = trained_model()
    loose = LatencyPolicy(SchedulerConfig(ttft_slo_ms=10_000, max_num_batched_tokens=512, max_num_seqs=64), 16)
    tight = LatencyPolicy(SchedulerConfig(ttft_slo_ms=600, max_num_batched_tokens=512, max_num_seqs=64), 16)
    loose.model = tight.model = model
    assert loose.plan(num_running=0, next_prompt_tokens=1000).max_running == 64
    depth = tight.plan(num_running=0, next_prompt_tokens=1000).max_running
    # The deepest batch that still prefills a 1000-token prompt within 600 ms, and not one deeper.
    assert 1 < depth < 64
    assert tight.projected_prefill_seconds(depth, 1000) <= 0.600 < tight.projected_prefill_seconds(depth + 1, 1000)


def test_cold_model_applies_the_configured_maxima():
    config = SchedulerConfig(ttft_slo_ms=1, itl_slo_ms=1, max_num_batched_tokens=2048, max_num_seqs=32)
    policy = LatencyPolicy(config, min_chunk=16)
    plan = policy.plan(num_running=5, next_prompt_tokens=100)
    assert (plan.token_budget, plan.max_running) == (2048, 32)


def test_engine_projects_ttft_for_every_waiting_request_in_queue_order(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    assert engine.scheduler.projected_ttft_seconds() == {}
    for i in range(12):  # warm the step-time model
        engine.add_request(f"warm{i}", list(range(1, 40 + 10 * i)), params)
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(6):
        engine.add_request(f"q{i}", list(range(1, 100)), params)
    projections = engine.scheduler.projected_ttft_seconds()
    assert list(projections) == [f"q{i}" for i in range(6)]
    values = list(projections.values())
    assert all(v > 0 for v in values) and values == sorted(values)


@pytest.mark.parametrize(
    ("option", "value"),
    [("ttft_slo_ms", 0), ("itl_slo_ms", -5), ("ttft_slo_ms", float("nan")), ("page_size", 12), ("page_size", 0)],
)
def test_bad_configuration_names_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        LLMEngine(EngineConfig(model=TINY_RANDOM_MODEL_NAME, **{option: value}))


def test_a_budget_that_fits_no_page_names_the_option():
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLMEngine(EngineConfig(model=TINY_RANDOM_MODEL_NAME, kv_cache_bytes=100))
