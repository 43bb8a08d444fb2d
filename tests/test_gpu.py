"""On a CUDA device: the same engine, in float32 and in the default bfloat16. Skipped without one."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, transformers_greedy

from gpu_runtime import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_float32_on_cuda_equals_transformers(llama_dir):
    prompts = random_prompts(8, 1, 200, seed=11)
    llm = LLM(str(llama_dir), device="cuda", dtype="float32", max_num_seqs=4)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(llama_dir, prompts, 24)


def test_auto_dtype_on_cuda_is_bfloat16_and_sizes_the_pool_from_free_memory(llama_dir):
    llm = LLM(str(llama_dir), device="cuda")
    assert llm.engine.dtype == torch.bfloat16
    assert llm.engine.kv.num_pages > 1000  # a share of the device's free memory, not the CPU default
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
