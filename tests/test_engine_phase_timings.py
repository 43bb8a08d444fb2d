"""What the scheduler tells the frontend for vLLM's metrics: each request's queue time, on its first token's delta,
and the tokens every engine step computed."""

from __future__ import annotations

import time

import pytest

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.ipc.messages import ITERATION_TOKEN_BUCKETS


@pytest.fixture()
def engine(llama_dir):
    # One slot: a second request waits in the scheduler's queue until the first has finished.
    return LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1, kv_cache_bytes=64 << 20))


def test_a_request_waiting_for_a_slot_reports_its_wait_on_its_first_token(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("first", [1, 2, 3, 4, 5, 6], params)
    engine.add_request("second", [7, 8, 9], params)
    second_added = time.monotonic()
    deltas: dict[str, list] = {"first": [], "second": []}
    first_done = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
            if delta.request_id == "first" and delta.finished:
                first_done = time.monotonic()
    for request_id in deltas:
        head, *rest = deltas[request_id]
        assert head.queued_s is not None and head.queued_s >= 0, head
        assert all(delta.queued_s is None for delta in rest)  # said once, on the first token's delta
    # The second request was first scheduled in a step after the first one ended, whose length this test saw.
    assert deltas["second"][0].queued_s >= first_done - second_added


def test_every_step_is_counted_with_the_tokens_it_computed(engine):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 21)), params)
    engine.add_request("b", list(range(30, 40)), params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.stats
    assert len(stats.iteration_token_counts) == len(ITERATION_TOKEN_BUCKETS) + 1
    assert sum(stats.iteration_token_counts) == steps
    assert stats.iteration_tokens_sum == (20 + 3) + (10 + 3)  # each prompt once, then one token per decode
    # One slot, so one request per step: the prefills (20 and 10 tokens) in (16, 32] and (8, 16], decodes in [1, 1].
    assert stats.iteration_token_counts[0] == 6
    assert stats.iteration_token_counts[ITERATION_TOKEN_BUCKETS.index(16)] == 1
    assert stats.iteration_token_counts[ITERATION_TOKEN_BUCKETS.index(32)] == 1
