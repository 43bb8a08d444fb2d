"""On a CUDA device: the engine in float32 and in bfloat16 against transformers, the cached and chunked paths,
seeds across devices, and a pool past 2^31 elements. Run with `TOKEND_TEST_GPU=1 pytest -m gpu` (the conftest hides
CUDA from the rest of the suite); skipped without a device."""

from __future__ import annotations

import pytest
import torch
from checkpoints import LLAMA_GQA, write_checkpoint
from conftest import random_prompts, transformers_greedy

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.kv_cache.kv_pool import page_bytes
from gpu_runtime.model.config import load_model_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and TOKEND_TEST_GPU=1)"),
]

BF16_PROMPTS = 12
# The largest gap allowed between our logprob of a token and transformers' (both bfloat16 models, logprobs taken
# in float32): a bfloat16 logit of magnitude 8 to 16 is only known to 1/16, and both sides round differently.
BF16_LOGPROB_TOLERANCE = 0.25


def greedy(num_tokens: int, **options) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, **options)


def token_ids(llm: LLM, prompts: list[list[int]], params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_float32_on_cuda_equals_transformers(llama_dir):
    prompts = random_prompts(8, 1, 200, seed=11)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_seqs=4)
    assert token_ids(llm, prompts, greedy(24)) == transformers_greedy(llama_dir, prompts, 24)


def test_auto_dtype_on_cuda_is_bfloat16_and_sizes_the_pool_from_free_memory(llama_dir):
    llm = LLM(str(llama_dir), device="cuda")
    assert llm.engine.dtype == torch.bfloat16
    assert llm.engine.kv.num_pages > 1000  # a share of the device's free memory, not the CPU default
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(8))
    assert len(out[0].outputs[0].token_ids) == 8


@torch.inference_mode()
def test_bfloat16_agrees_with_transformers_bfloat16(llama_dir):
    """transformers in bfloat16 on the same device, run over each prompt and our greedy tokens: its argmax is our
    token at every position for 11 of 12 prompts at least, and its logprob of our token is within tolerance."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(BF16_PROMPTS, 4, 120, seed=21)
    llm = LLM(str(llama_dir), device="cuda", dtype="bfloat16", max_num_seqs=BF16_PROMPTS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16, logprobs=0))
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16).to("cuda").eval()
    agreeing, max_delta = 0, 0.0
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = output.outputs[0].token_ids
        logits = reference(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        agreeing += logits.argmax(-1).tolist() == tokens
        theirs = logits.log_softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
        ours = [lp.logprob for lp in output.outputs[0].logprobs]
        max_delta = max(max_delta, *(abs(a - b) for a, b in zip(theirs, ours, strict=True)))
    assert agreeing >= BF16_PROMPTS - 1
    assert max_delta < BF16_LOGPROB_TOLERANCE


def test_cached_and_chunked_paths_equal_transformers(llama_dir):
    """Prompts sharing a 150-token prefix, prefilled in 64-token chunks, twice: both runs give transformers'
    tokens, and the second reads the prefix from the cache."""
    shared = random_prompts(1, 150, 150, seed=31)[0]
    prompts = [shared + tail for tail in random_prompts(6, 1, 40, seed=32)]
    expected = transformers_greedy(llama_dir, prompts, 16)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_batched_tokens=64, max_num_seqs=8)
    assert token_ids(llm, prompts, greedy(16)) == expected
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(16))
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) >= 150 * len(prompts) // 2


def test_a_seed_gives_the_same_tokens_in_any_batch_and_on_the_cpu(llama_dir):
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    others = SamplingParams(max_tokens=24, temperature=1.0, top_k=20, ignore_eos=True)
    prompt, mates = random_prompts(1, 30, 30, seed=41)[0], random_prompts(7, 5, 60, seed=42)
    on_cuda = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_seqs=8)
    alone = token_ids(on_cuda, [prompt], seeded)[0]
    assert len(set(alone)) > 3, "the seeded draws should vary"
    in_batch = token_ids(on_cuda, mates[:3] + [prompt] + mates[3:], [others] * 3 + [seeded] + [others] * 4)[3]
    assert in_batch == alone
    on_cpu = LLM(str(llama_dir), device="cpu", dtype="float32", kv_cache_bytes=64 << 20)
    assert token_ids(on_cpu, [prompt], seeded)[0] == alone


def test_a_pool_past_2_31_elements_starts_and_serves(tmp_path):
    """K/V tensors of more than 2^31 elements each (1.3 M pages of 16 tokens) index correctly: the same greedy
    tokens as from a small pool."""
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072)
    model_dir = write_checkpoint(tmp_path, LLAMA_GQA, **shape)
    prompts = random_prompts(4, 10, 80, seed=51)
    small = LLM(str(model_dir), device="cuda", dtype="bfloat16", kv_cache_bytes=16 << 20)
    expected = token_ids(small, prompts, greedy(16))
    del small
    torch.cuda.empty_cache()
    big = LLM(str(model_dir), device="cuda", dtype="bfloat16", kv_cache_bytes=20 << 30, max_num_seqs=256)
    config = load_model_config(model_dir)
    elements = big.engine.kv.num_pages * page_bytes(config, 16, torch.bfloat16) // (2 * config.num_layers * 2)
    assert elements > 2**31
    assert token_ids(big, prompts, greedy(16)) == expected
