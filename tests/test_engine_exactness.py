"""Greedy outputs equal transformers' token for token, however the batch is formed or squeezed."""

from __future__ import annotations

from conftest import NUM_REFERENCE_TOKENS, kv_bytes_for

from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=NUM_REFERENCE_TOKENS, temperature=0, ignore_eos=True)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_batched_generate_equals_transformers(reference_case):
    model_dir, prompts, expected = reference_case
    # 8 slots for 16 prompts: later prompts are admitted while earlier ones are decoding.
    llm = LLM(str(model_dir), max_num_seqs=8, max_num_batched_tokens=1024)
    outputs = llm.generate(token_prompts(prompts), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert [o.prompt_token_ids for o in outputs] == prompts


def test_requests_joining_mid_decode_equal_transformers(reference_case):
    model_dir, prompts, expected = reference_case
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_num_seqs=16))
    tokens = {str(i): [] for i in range(len(prompts))}
    mixed_steps = 0
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every other step, while the others keep decoding
            index, prompt = pending.pop(0)
            engine.add_request(str(index), prompt, GREEDY)
        prefilled, decoded = engine.stats.num_prefill_tokens, engine.stats.num_decode_tokens
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        # A step that both prefilled a newcomer and decoded the running batch.
        mixed_steps += engine.stats.num_prefill_tokens > prefilled and engine.stats.num_decode_tokens > decoded
        if engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
    assert mixed_steps > 0
    assert [tokens[str(i)] for i in range(len(prompts))] == expected


def test_tiny_page_pool_waits_and_preempts_without_changing_outputs(reference_case):
    model_dir, prompts, expected = reference_case
    # page_size 4 and 100 pages (400 tokens): about one full sequence at a time, so requests wait
    # for pages and running ones are preempted when decoding runs out.
    llm = LLM(str(model_dir), page_size=4, max_num_seqs=16, kv_cache_bytes=kv_bytes_for(model_dir, 4, 100))
    outputs = llm.generate(token_prompts(prompts), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.stats.num_preemptions > 0
    assert llm.engine.kv.num_free_pages == llm.engine.kv.num_pages  # every page came back


def test_static_scheduling_gives_the_same_outputs(reference_case):
    model_dir, prompts, expected = reference_case
    llm = LLM(str(model_dir), max_num_seqs=6, scheduling="static")
    outputs = llm.generate(token_prompts(prompts), GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
