"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob where it stands, and the top n
there, equal to transformers' teacher-forced log-softmax, with chunked prefill splitting prompts across steps and the
prefix cache on; a cached prefix is computed again for a request that scores it, and its pages still serve the
requests after it; the sampled tokens are those of the same request without it."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import LLAMA_GQA, write_checkpoint
from conftest import kv_bytes_for

from gpu_runtime import LLM, SamplingParams

TOP = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("prompt-logprobs"), LLAMA_GQA)


@pytest.fixture(scope="module")
def teacher_forced(model_dir):
    """transformers' log-softmax at every position of a prompt: [len(prompt), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)

    return logprobs


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]  # some prompts begin alike: their pages are cached
    prompts = []
    for index in range(count):
        own = [rng.randrange(3, 250) for _ in range(rng.randint(1, 160))]
        prompts.append(shared + own if index % 3 == 0 else own)
    return prompts


def _check(prompt: list[int], entries, reference: torch.Tensor, top: int = TOP) -> None:
    """Each entry against transformers' log-softmax at its position (and its top `top` values)."""
    assert len(entries) == len(prompt) and entries[0] is None  # the first token has none, as vLLM's
    for position, entry in enumerate(entries[1:]):
        expected = reference[position]
        assert entry.token_id == prompt[position + 1]
        assert abs(entry.logprob - expected[prompt[position + 1]].item()) < TOLERANCE, (len(prompt), position)
        top_values, _ = expected.topk(top)
        assert [value for _, value in entry.top] == pytest.approx(top_values.tolist(), abs=TOLERANCE)


def test_prompt_logprobs_equal_transformers_teacher_forced_with_chunked_prefill_and_the_prefix_cache(
    model_dir, teacher_forced
):
    prompts = _prompts(32, seed=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    # 48-token steps: most prompts are scored over several chunks, and several prompts share a step.
    with LLM(str(model_dir), max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True) as llm:
        llm.generate(requests[:4], SamplingParams(max_tokens=1, temperature=0))  # the shared prefix is cached now
        scored = llm.generate(requests, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=TOP))
        plain = llm.generate(requests, SamplingParams(max_tokens=4, temperature=0))
    for prompt, output in zip(prompts, scored, strict=True):
        _check(prompt, output.prompt_logprobs, teacher_forced(prompt))
        assert output.num_cached_tokens == 0  # every position it scores is computed
    assert [o.outputs[0].token_ids for o in scored] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    assert sum(o.num_cached_tokens for o in plain) > 0  # the scored requests' pages serve the ones after them


def test_a_prompt_scored_after_preemption_is_scored_once(model_dir, teacher_forced):
    """A pool too small for the batch preempts running requests and recomputes them: each prompt's logprobs still
    come once, whole and right."""
    prompts = _prompts(12, seed=5)
    with LLM(str(model_dir), max_num_batched_tokens=64, max_num_seqs=12, enable_prefix_caching=True,
             kv_cache_bytes=kv_bytes_for(model_dir, 16, 40)) as llm:  # fmt: skip
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, prompt_logprobs=TOP),
        )
        preemptions = llm.engine.stats.num_preemptions
    assert preemptions > 0
    for prompt, output in zip(prompts, outputs, strict=True):
        _check(prompt, output.prompt_logprobs, teacher_forced(prompt))


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(model_dir, teacher_forced):
    prompt = _prompts(1, seed=7)[0]
    with LLM(str(model_dir), max_num_batched_tokens=48, max_num_seqs=8) as llm:
        [output] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "length"
    _check(prompt, output.prompt_logprobs, teacher_forced(prompt), top=0)


@pytest.mark.parametrize(
    "fields", [{"prompt_logprobs": -1}, {"prompt_logprobs": 21}, {"prompt_logprobs": 1.5}, {"max_tokens": 0}]
)
def test_a_bad_prompt_logprobs_or_a_request_for_nothing_is_refused_naming_the_field(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingParams(**fields)
