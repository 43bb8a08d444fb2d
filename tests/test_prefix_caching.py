"""Prefix caching and chunked prefill: they save work, never change outputs, and give pages back."""

from __future__ import annotations

import pytest
from conftest import NUM_REFERENCE_TOKENS, kv_bytes_for, random_prompts

from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=NUM_REFERENCE_TOKENS, temperature=0, ignore_eos=True)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def shared_prefix_prompts(count: int, prefix_len: int, seed: int) -> list[list[int]]:
    prefix = random_prompts(1, prefix_len, prefix_len, seed=seed)[0]
    return [prefix + suffix for suffix in random_prompts(count, 1, 40, seed=seed + 1)]


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_outputs_equal_transformers_with_caching_and_chunking_on_or_off(
    reference_case, enable_prefix_caching, enable_chunked_prefill
):
    model_dir, prompts, expected = reference_case
    llm = LLM(
        str(model_dir),
        max_num_seqs=8,
        max_num_batched_tokens=32,  # a 300-token prompt takes ten steps when chunked
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    # The prompts twice: the second round finds every full page of its prompt cached (when caching is on).
    outputs = llm.generate(token_prompts(prompts + prompts), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected + expected
    cached = [o.num_cached_tokens for o in outputs[len(prompts) :]]
    if enable_prefix_caching:
        assert all(c == (len(p) - 1) // 16 * 16 for c, p in zip(cached, prompts, strict=True))
    else:
        assert not any(cached)


def test_shared_prefix_is_computed_once_and_its_pages_held_once(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=16))
    prompts = shared_prefix_prompts(8, 256, seed=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("first", prompts[0], params)
    engine.step()  # the first request computes (and caches) the shared prefix
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(str(i), prompt, params)
    engine.step()  # the rest are admitted together, reusing the prefix's 16 pages
    unique_pages = sum(-(-len(p) // 16) - 16 for p in prompts)
    assert engine.kv.num_used_pages <= 16 + unique_pages + len(prompts)
    snapshot = engine.snapshot()
    assert snapshot.prefix_hit_tokens == 7 * 256
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_prefill_tokens == sum(len(p) for p in prompts) - 7 * 256


def test_outputs_unchanged_after_cached_pages_are_evicted_and_refilled(reference_case):
    model_dir, prompts, expected = reference_case
    # 120 pages of 4 tokens: caching one round of prompts evicts the previous round's pages.
    llm = LLM(str(model_dir), page_size=4, max_num_seqs=4, kv_cache_bytes=kv_bytes_for(model_dir, 4, 120))
    first = llm.generate(token_prompts(prompts[:8]), GREEDY)
    evictions_before = llm.engine.kv.allocator.num_evictions
    second = llm.generate(token_prompts(prompts[8:] + prompts[:8]), GREEDY)
    assert llm.engine.kv.allocator.num_evictions > evictions_before
    assert [o.outputs[0].token_ids for o in first] == expected[:8]
    assert [o.outputs[0].token_ids for o in second] == expected[8:] + expected[:8]


def test_with_a_host_tier_evicted_prefixes_come_back_from_host_memory_and_outputs_stay_those_of_transformers(
    reference_case,
):
    """--kv-offload-bytes: the second round finds the first round's evicted pages in the host tier instead of
    recomputing them, and every output is still transformers' greedy continuation (greedy identical with the tier
    on and off: the other test of this pool size has it off)."""
    model_dir, prompts, expected = reference_case
    llm = LLM(str(model_dir), page_size=4, max_num_seqs=4, kv_cache_bytes=kv_bytes_for(model_dir, 4, 120),
              kv_offload_bytes=kv_bytes_for(model_dir, 4, 2000))  # fmt: skip
    first = llm.generate(token_prompts(prompts[:8]), GREEDY)
    second = llm.generate(token_prompts(prompts[8:] + prompts[:8]), GREEDY)
    host = llm.engine.kv.host
    assert host.num_offloaded > 0 and host.num_loaded > 0
    assert [o.outputs[0].token_ids for o in first] == expected[:8]
    assert [o.outputs[0].token_ids for o in second] == expected[8:] + expected[:8]
    # The first round's full pages came back (from the device pool where still there, else from the host tier).
    revisited = [o.num_cached_tokens for o in second[8:]]
    assert revisited == [(len(p) - 1) // 4 * 4 for p in prompts[:8]]
    assert llm.engine.kv.num_host_hit_tokens > 0  # (a preempted request's reload counts as a load, not a hit)
    llm.engine.check_integrity()


def test_chunked_prefill_keeps_decodes_flowing_while_a_long_prompt_arrives(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=8, max_num_batched_tokens=32))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"stream{i}", [i + 1, 2, 3], params)
    engine.step()
    engine.add_request("long", random_prompts(1, 600, 600, seed=9)[0], params)
    steps_until_first_token, stream_tokens = 0, 0
    while True:
        outputs = engine.step()
        steps_until_first_token += 1
        stream_tokens += sum(1 for o in outputs if o.request_id.startswith("stream"))
        if any(o.request_id == "long" for o in outputs):
            break
    # 600 tokens at 28 spare tokens a step: about 22 steps, each also giving every stream its token.
    assert steps_until_first_token >= 600 // 32
    assert stream_tokens == 4 * steps_until_first_token


def test_a_preempted_request_finds_its_own_prefix_again(llama_dir):
    engine = LLMEngine(
        EngineConfig(model=str(llama_dir), page_size=4, max_num_seqs=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 60))
    )
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(1, 60)), params)
    engine.add_request("b", list(range(100, 159)), params)
    prefill_before = 0
    while engine.has_unfinished_requests():
        engine.step()
        prefill_before = engine.stats.num_prefill_tokens
    assert engine.stats.num_preemptions > 0
    hits = engine.snapshot().prefix_hit_tokens  # first-admission hits only; recompute hits are below
    recomputed = prefill_before - 2 * 59
    lost = engine.stats.num_preemptions * (59 + 120)
    assert hits == 0 and recomputed < lost  # the victim recomputed less than its whole history
