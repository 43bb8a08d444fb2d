"""The step-level engine as a caller sees it: validation, abort, stop conditions, seeded sampling."""

from __future__ import annotations

import math

import pytest
from conftest import kv_bytes_for, random_prompts

from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=8, kv_cache_bytes=64 << 20))


def drain(engine: LLMEngine, earlier_outputs=()) -> dict[str, tuple[list[int], str]]:
    """Steps until idle; returns each finished request's tokens (earlier steps' included) and reason."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    outputs = list(earlier_outputs)
    while outputs or engine.has_unfinished_requests():
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        outputs = engine.step() if engine.has_unfinished_requests() else []
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in reasons}


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], {}, "prompt"),
        ([1, 2, 258], {}, "prompt_token_ids"),
        ([1, -1], {}, "prompt_token_ids"),
        ([5] * 1024, {}, "prompt"),  # the context is 1024 tokens: no room left to generate
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"temperature": -0.5}, "temperature"),
        ([1, 2], {"temperature": math.nan}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"top_k": -1}, "top_k"),
    ],
)
def test_bad_input_names_the_field_and_others_keep_running(engine, prompt, params, field):
    engine.add_request("good", [1, 2, 3], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    first = engine.step()
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**params))
    finished = drain(engine, first)
    assert finished["good"][1] == "length" and len(finished["good"][0]) == 6
    assert "bad" not in finished


def test_request_that_can_never_fit_the_pool_is_rejected_at_once(llama_dir):
    tiny = LLMEngine(EngineConfig(model=str(llama_dir), page_size=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 4)))
    assert tiny.kv.num_pages == 4  # 16 tokens in all
    with pytest.raises(ValueError, match="max_tokens"):
        tiny.add_request("huge", list(range(10)), SamplingParams(max_tokens=50))
    tiny.add_request("small", list(range(10)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert drain(tiny)["small"][1] == "length"


def test_abort_mid_decode_frees_its_pages_and_reports_abort(engine):
    engine.add_request("long", list(range(40)), SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
    engine.add_request("short", list(range(30)), SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    final = engine.abort_request("long")
    assert final.finish_reason == "abort" and final.num_output_tokens == 3
    assert engine.abort_request("long") is None  # unknown now
    assert drain(engine)["short"][1] == "length"
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_abort_of_a_waiting_request(engine):
    engine.add_request("queued", [1, 2, 3], SamplingParams(max_tokens=5))
    assert engine.abort_request("queued").finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_stop_token_ids_and_eos_end_a_sequence(engine):
    engine.add_request("probe", [7, 8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    tokens, _ = drain(engine)["probe"]
    stop_at = tokens[4]
    engine.add_request("stops", [7, 8, 9], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop_at,)))
    stopped, reason = drain(engine)["stops"]
    assert reason == "stop"
    assert stopped == tokens[: tokens.index(stop_at) + 1]  # the stop token is the last one returned


def test_eos_stops_unless_ignore_eos(llama_dir):
    llm = LLM(str(llama_dir))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(24, 1, 40, seed=3)]
    stopped = llm.generate(prompts, SamplingParams(max_tokens=300, temperature=1.5, seed=0))
    eos_ended = [o for o in stopped if o.outputs[0].finish_reason == "stop"]
    assert eos_ended, "some sampled sequence should reach eos (id 257) within 300 tokens"
    assert all(o.outputs[0].token_ids[-1] == 257 for o in eos_ended)
    ignored = llm.generate(prompts, SamplingParams(max_tokens=300, temperature=1.5, seed=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 300 for o in ignored)


def test_seeded_request_samples_the_same_tokens_alone_and_in_a_batch_of_32(llama_dir):
    llm = LLM(str(llama_dir), max_num_seqs=32)
    seeded = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True)
    prompt = {"prompt_token_ids": [10, 20, 30, 40]}
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": p} for p in random_prompts(31, 1, 60, seed=5)]
    batch_params = [SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)] * 31
    batch = llm.generate(others[:15] + [prompt] + others[15:], batch_params[:15] + [seeded] + batch_params[15:])
    assert batch[15].outputs[0].token_ids == alone
    # And the seed matters: another seed gives another sequence.
    other_seed = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, top_k=50, seed=43, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].outputs[0].token_ids != alone


def test_logprobs_of_greedy_tokens_are_the_most_likely(engine):
    llm_params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    engine.add_request("lp", [3, 4, 5], llm_params)
    logprobs = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs.extend(out.new_logprobs or [])
    assert len(logprobs) == 5
    for lp in logprobs:
        top = dict(lp.top)
        assert lp.top[0][0] == lp.token_id and lp.logprob == pytest.approx(max(top.values()))
        assert len(lp.top) == 3 and lp.logprob <= 0
