"""Page export/import: a prompt's K/V moves from one engine's pool into another's prefix cache."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def generate(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(request_id, prompt, GREEDY)
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


def test_imported_pages_serve_a_request_as_if_computed_here(llama_dir):
    prefill_worker = LLMEngine(EngineConfig(model=str(llama_dir)))
    decode_worker = LLMEngine(EngineConfig(model=str(llama_dir)))
    prompt = random_prompts(1, 200, 200, seed=21)[0]
    expected, _ = generate(prefill_worker, "p", prompt)

    export = prefill_worker.export_prefix(prompt)
    assert export.num_pages == 200 // 16
    assert decode_worker.import_prefix(export) == 12
    assert decode_worker.import_prefix(export) == 0  # already cached: nothing written twice
    decode_worker.check_integrity()
    assert decode_worker.kv.num_used_pages == 0  # imported pages sit in the cache, owned by no one

    tokens, cached = generate(decode_worker, "d", prompt)
    assert cached == 192 and tokens == expected
    assert decode_worker.stats.num_prefill_tokens == 200 - 192


def test_import_refuses_a_pool_with_another_page_size(llama_dir):
    source = LLMEngine(EngineConfig(model=str(llama_dir)))
    generate(source, "p", list(range(1, 70)))
    with pytest.raises(ValueError, match="page_size"):
        LLMEngine(EngineConfig(model=str(llama_dir), page_size=8)).import_prefix(
            source.export_prefix(list(range(1, 70)))
        )


def test_a_prefill_worker_with_a_host_tier_hands_over_pages_it_loaded_back_from_host_memory(llama_dir):
    """A prefill worker whose pool evicted a conversation's pages gets them back from its host tier for the next
    turn (nothing recomputed), and the pages it hands the decode worker hold that prompt's K/V: the decode worker's
    tokens are those of a worker that computed the whole prompt itself."""
    from conftest import kv_bytes_for

    page_bytes = kv_bytes_for(llama_dir, 16, 1)
    prefill_worker = LLMEngine(EngineConfig(model=str(llama_dir), kv_cache_bytes=16 * page_bytes,
                                            kv_offload_bytes=64 * page_bytes))  # fmt: skip
    decode_worker = LLMEngine(EngineConfig(model=str(llama_dir)))
    prompt, crowd = random_prompts(2, 200, 200, seed=22)
    expected, _ = generate(LLMEngine(EngineConfig(model=str(llama_dir))), "reference", prompt)
    generate(prefill_worker, "first-turn", prompt)
    generate(prefill_worker, "crowd", crowd)  # its 13 pages and more: the first turn's pages leave the pool
    assert prefill_worker.kv.host.num_offloaded > 0
    _, cached = generate(prefill_worker, "second-turn", prompt)
    assert cached == 192 and prefill_worker.kv.num_host_hit_tokens > 0  # what left the pool came back from host

    assert decode_worker.import_prefix(prefill_worker.export_prefix(prompt)) == 12
    tokens, cached = generate(decode_worker, "d", prompt)
    assert cached == 192 and tokens == expected
