"""Structured outputs in the engine, on the real default model (SmolLM2-135M-Instruct) in process: the masking is
exactly transformers' with the same llguidance mask, sampled outputs validate against their schemas, and
constraints compose with mixed batches, preemption, continuations on another worker and logprobs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import kv_bytes_for
from harness.schema_corpus import schemas, validator
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.default_model import DEFAULT_MODEL_NAME, ensure_default_model, ensure_tiny_random_model
from gpu_runtime.ipc.structured_output import StructuredOutput

pytestmark = pytest.mark.engine

PROMPT = "<|im_start|>user\nReply with a short JSON object about a city.<|im_end|>\n<|im_start|>assistant\n"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
GREEDY_CASES = [
    StructuredOutput.json_schema(PERSON),
    StructuredOutput.json_object(),
    StructuredOutput.regex(r"[0-9]{3}-[a-z]{2,5}"),
    StructuredOutput.choice(["Paris", "London", "Rome"]),
    StructuredOutput.grammar('start: "The city is " CITY "."\nCITY: /[A-Z][a-z]+/'),
]


@pytest.fixture(scope="module")
def llm():
    # Float32 (quantization none): transformers, the reference, reads the same weights so.
    with LLM(DEFAULT_MODEL_NAME, max_num_seqs=64, quantization="none") as llm:
        yield llm


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()


class _LLGuidanceMask:
    """A transformers logits processor: the llguidance mask of one grammar, advanced by the tokens generated."""

    def __init__(self, matcher, prompt_len: int):
        self.matcher, self.consumed = matcher, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        assert self.matcher.consume_tokens(input_ids[0, self.consumed :].tolist())
        self.consumed = input_ids.shape[1]
        if self.matcher.is_stopped():  # complete: only the end may follow
            return torch.full_like(scores, float("-inf")).index_fill_(1, torch.tensor([2]), 0.0)
        bitmask = allocate_token_bitmask(1, scores.shape[-1])
        fill_next_token_bitmask(self.matcher, bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, : scores.shape[-1]]
        return scores.masked_fill(torch.from_numpy(bits == 0), float("-inf"))


def _masked_greedy(model, compiler, output: StructuredOutput, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, each step's logits masked by a fresh llguidance matcher of the same grammar;
    once the grammar is complete its mask allows only the end (token 2), where generation stops."""
    ids = torch.tensor([prompt])
    mask = _LLGuidanceMask(compiler.matcher(output), len(prompt))
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=2, logits_processor=[mask])  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    return tokens[:-1] if tokens and tokens[-1] == 2 else tokens


@pytest.mark.parametrize("output", GREEDY_CASES, ids=lambda o: o.kind.value)
def test_greedy_masked_tokens_equal_transformers_with_the_same_llguidance_mask(llm, reference, output):
    prompt = llm.tokenizer.encode(PROMPT)
    (ours,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=32, temperature=0,
                                                                          structured_output=output))  # fmt: skip
    expected = _masked_greedy(reference, llm.engine.grammars, output, prompt, 32)
    assert ours.outputs[0].token_ids == expected
    if ours.outputs[0].finish_reason == "stop":
        assert llm.engine.grammars.matcher(output).consume_tokens(expected)


def test_sampled_outputs_that_stop_validate_against_their_schemas(llm):
    corpus = schemas(12, seed=7)  # the 200-schema run is scripts/check_structured_outputs.py
    params = [SamplingParams(max_tokens=128, temperature=1.0, seed=i, structured_output=StructuredOutput.json_schema(s))
              for i, s in enumerate(corpus)]  # fmt: skip
    outputs = llm.generate([PROMPT] * len(corpus), params)
    stopped = [
        (s, o.outputs[0].text) for s, o in zip(corpus, outputs, strict=True) if o.outputs[0].finish_reason == "stop"
    ]
    assert len(stopped) >= len(corpus) // 2, "most outputs should finish inside 128 tokens"
    for schema, text in stopped:
        validator(schema).validate(json.loads(text))


def test_regex_and_choice_outputs_match_at_temperature_one(llm):
    regex, choices = r"[A-Z][a-z]{2,8} [0-9]{1,3}", ["red", "green", "blue", "dark green"]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=i, structured_output=StructuredOutput.regex(regex))
              for i in range(8)]  # fmt: skip
    params += [SamplingParams(max_tokens=8, temperature=1.0, seed=i, structured_output=StructuredOutput.choice(choices))
               for i in range(8)]  # fmt: skip
    outputs = llm.generate([PROMPT] * len(params), params)
    for output in outputs[:8]:
        assert output.outputs[0].finish_reason == "stop" and re.fullmatch(regex, output.outputs[0].text)
    for output in outputs[8:]:
        assert output.outputs[0].finish_reason == "stop" and output.outputs[0].text in choices


def test_free_rows_beside_constrained_ones_keep_their_exact_tokens(llm):
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (alone,) = llm.generate(PROMPT, free)
    constrained = SamplingParams(max_tokens=24, temperature=1.0, seed=3,
                                 structured_output=StructuredOutput.json_schema(PERSON))  # fmt: skip
    mixed = llm.generate([PROMPT] * 4, [free, constrained, free, constrained])
    assert mixed[0].outputs[0].token_ids == mixed[2].outputs[0].token_ids == alone.outputs[0].token_ids


def test_preempted_constrained_requests_resume_with_their_matcher_and_validate():
    # 24 pages of 16 tokens for eight sequences of up to 126 tokens each: the scheduler has to preempt and recompute.
    # The tiny model (byte tokens) at a tenth of the default's step: preemption does not depend on the weights.
    words = r"(?:[a-z]{3,8} ){12}[a-z]{3,8}\."  # at most 117 bytes: every sequence can end within its 120 tokens
    model_dir = ensure_tiny_random_model()
    with LLM(str(model_dir), kv_cache_bytes=kv_bytes_for(model_dir, 16, 24), max_num_seqs=8) as small:
        output = StructuredOutput.regex(words)
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_output=output) for i in range(8)]
        outputs = small.generate(["Words:"] * 8, params)
        assert small.engine.stats.num_preemptions > 0
    stopped = [output.outputs[0].text for output in outputs if output.outputs[0].finish_reason == "stop"]
    assert len(stopped) == 8 and all(re.fullmatch(words, text) for text in stopped)


@pytest.mark.parametrize("cut", [1, 7])  # 1: a P/D handover (the prefill worker's first token); 7: a migration
def test_a_continuation_replays_its_tokens_into_the_matcher_and_ends_as_the_uninterrupted_request(llm, cut):
    prompt = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput.json_schema(PERSON))
    (whole,) = llm.generate({"prompt_token_ids": prompt}, params)
    tokens = whole.outputs[0].token_ids
    engine = llm.engine
    rest = SamplingParams(max_tokens=40 - cut, temperature=0, structured_output=params.structured_output)
    engine.add_request(f"continued-{cut}", prompt + tokens[:cut], rest, num_generated=cut)
    continued = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            continued += delta.new_token_ids
            finish = delta.finish_reason
    assert tokens[:cut] + continued == tokens
    assert finish == whole.outputs[0].finish_reason


def test_logprobs_are_those_of_the_masked_distribution(llm):
    output = StructuredOutput.choice(["yes", "no"])
    (result,) = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=20, structured_output=output))
    first = result.outputs[0].logprobs[0]
    bitmask = allocate_token_bitmask(1, llm.engine.model_config.vocab_size)
    fill_next_token_bitmask(llm.engine.grammars.matcher(output), bitmask)
    allowed = set(np.flatnonzero(np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")).tolist())
    assert 2 <= len(allowed) <= 20  # "y", "ye", "yes", "n", "no"...: all of them among the top 20
    finite = {token: logprob for token, logprob in first.top if logprob > float("-inf")}
    assert first.token_id in allowed and set(finite) == allowed
    assert sum(np.exp(list(finite.values()))) == pytest.approx(1.0, abs=1e-4)  # renormalised over what is allowed


def test_the_offline_api_refuses_a_spec_that_cannot_be_enforced_naming_the_field(llm):
    bad = SamplingParams(structured_output=StructuredOutput.json_schema({"type": "array", "uniqueItems": True}))
    with pytest.raises(ValueError, match=r"^structured_output\.json_schema: Unimplemented keys"):
        llm.generate(PROMPT, bad)
    assert not llm.engine.has_unfinished_requests()


def test_a_model_without_an_end_of_sequence_token_warms_up_and_refuses_structured_outputs_naming_the_field(tmp_path):
    """Some checkpoints set no eos_token_id: the scheduler still starts (its warm-up skips the grammar) and serves,
    and a structured output, which a grammar ends with that token, is refused naming the field, in the frontend's
    compiler as in the engine."""
    import asyncio
    import shutil

    import grpc

    from frontend.metrics import FrontendMetrics
    from frontend.structured_outputs import GrammarChecks, StructuredOutputRefused
    from gpu_runtime.ipc.messages import SchedulerReady
    from gpu_runtime.structured.compiler import GrammarCompiler, GrammarError
    from gpu_runtime.worker.warm_up import warm_up

    model_dir = tmp_path / "no-eos"
    shutil.copytree(ensure_tiny_random_model(), model_dir)
    for name in ("config.json", "generation_config.json"):
        settings = json.loads((model_dir / name).read_text())
        settings.pop("eos_token_id", None)
        (model_dir / name).write_text(json.dumps(settings))
    llm = LLM(str(model_dir), device="cpu")
    assert llm.engine.model_config.eos_token_ids == ()
    warm_up(llm.engine)
    (out,) = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))
    assert len(out.outputs[0].token_ids) == 4
    constrained = SamplingParams(structured_output=StructuredOutput.regex("yes|no"))
    with pytest.raises(ValueError, match=r"^structured_output: the model has no end-of-sequence token"):
        llm.generate(PROMPT, constrained)
    with pytest.raises(GrammarError, match=r"no end-of-sequence token"):
        GrammarCompiler.for_model(model_dir, llm.engine.model_config.vocab_size, [])
    # The frontend, checking the request before it reaches a scheduler: INVALID_ARGUMENT naming the field sent.
    ready = SchedulerReady("w", "i", 1, "m", str(model_dir), "g", 2048, llm.engine.model_config.vocab_size, 64, 16, 8,
                           b"", eos_token_ids=())  # fmt: skip
    checks = GrammarChecks(FrontendMetrics())
    try:
        with pytest.raises(StructuredOutputRefused) as refused:
            asyncio.run(checks.check(constrained.structured_output, ready, None))
    finally:
        checks.close()
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and refused.value.reason == "invalid"
    assert refused.value.message.startswith("sampling.structured_output.regex: the model has no end-of-sequence")
