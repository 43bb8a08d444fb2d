"""Step-time coefficients measured on this machine: the real engine (the tiny random model) run offline on steps
of known sizes (decode-only batches of 1 to max_num_seqs sequences, single prefills up to the token budget), each
step timed with the tokens it computed. The first steps (cold start: allocator, kernels) are left out, and each
step size's 25th-percentile time is fitted, so that other processes' bursts on a shared machine do not skew it."""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

from common.autoscale_policy import StepCost, fit_step_model

SKIP_FIRST = 8


def measure_step_model(seconds: float, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[StepCost, dict]:
    import torch

    from gpu_runtime import SamplingParams
    from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
    from gpu_runtime.llm import LLM

    # One thread: on a machine whose cores other processes share, a multi-threaded step waits at every barrier for
    # its slowest thread, and the times measure the neighbours rather than the engine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(LLM, SamplingParams, TINY_RANDOM_MODEL_NAME, seconds, max_num_seqs, max_num_batched_tokens)
    finally:
        torch.set_num_threads(threads)


def _measure(llm_class, params_class, model_name, seconds, max_num_seqs, max_num_batched_tokens):
    engine = llm_class(
        model_name,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=False,  # every prompt computed in full, so a step computes the tokens it was given
    ).engine
    decode = params_class(max_tokens=16, ignore_eos=True)
    prefill_only = params_class(max_tokens=1, ignore_eos=True)
    batches = sorted({1, 4, max(1, max_num_seqs // 4), max(1, max_num_seqs // 2), max_num_seqs})
    prompts = sorted({64, max_num_batched_tokens // 4, max_num_batched_tokens // 2, max_num_batched_tokens - 8})
    samples: list[tuple[int, float]] = []
    start, n = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        for batch in batches:
            for _ in range(batch):  # prompts of 8 tokens: one prefill step, then decodes of `batch` tokens
                engine.add_request(str(n := n + 1), [(n * 7 + i) % 250 + 1 for i in range(8)], decode)
            _drain(engine, samples)
        for length in prompts:
            engine.add_request(str(n := n + 1), [(n * 3 + i) % 250 + 1 for i in range(length)], prefill_only)
            _drain(engine, samples)
    by_size: dict[int, list[float]] = defaultdict(list)
    for tokens, ms in samples[SKIP_FIRST:]:
        by_size[tokens].append(ms)
    quartiles = [(tokens, _low_quantile(times)) for tokens, times in sorted(by_size.items())]
    model = fit_step_model(quartiles)
    facts = {"engine": f"gpu_runtime.llm.LLM({model_name!r})", "torch_threads": 1, "steps": len(samples),
             "skip_first": SKIP_FIRST, "cold_steps_ms": [round(ms, 1) for _, ms in samples[:SKIP_FIRST]],
             "p25_ms_by_tokens": {str(t): round(ms, 2) for t, ms in quartiles}}  # fmt: skip
    return model, facts


def _drain(engine, samples: list[tuple[int, float]]) -> None:
    while engine.has_unfinished_requests():
        before = engine.stats.iteration_tokens_sum
        began = time.perf_counter()
        engine.step()
        samples.append((engine.stats.iteration_tokens_sum - before, (time.perf_counter() - began) * 1e3))


def _low_quantile(times: list[float]) -> float:
    """The 25th percentile: steps slowed by another process's burst sit above it, the engine's own cost below."""
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)
