"""Linear weights prepacked for oneDNN on the CPU: the same numbers as nn.Linear (an MoE block's stacked experts
too), every matmul of a float32 CPU engine packed, a tied embedding table left whole, and greedy outputs still
transformers'."""

from __future__ import annotations

import pytest
import torch
from checkpoints import LLAMA3_ROPE, write_checkpoint
from conftest import random_prompts, transformers_greedy
from torch import nn

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.model.config import ModelConfig, MoeConfig, RopeConfig
from gpu_runtime.model.cpu_weights import PackedLinear, can_prepack, dense_weight, prepack_linears
from gpu_runtime.model.moe import SparseMoeBlock
from gpu_runtime.model.moe_kernel import load_grouped_matmul

pytestmark = pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_a_packed_linear_computes_what_the_plain_one_does(bias, rows):
    torch.manual_seed(rows)
    plain = nn.Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    expected = plain(x)
    packed = PackedLinear(plain)
    torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense_weight(packed), plain.weight.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("path", ["kernel", "onednn"])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_prepared_experts_compute_what_the_stacked_ones_do(rows, path, monkeypatch):
    """The grouped-matmul kernel, or (where it cannot be built) each expert packed for oneDNN."""
    if path == "onednn":
        monkeypatch.setattr("gpu_runtime.model.moe.load_grouped_matmul", lambda: None)
    elif load_grouped_matmul() is None:
        pytest.skip("the MoE kernel cannot be built here")
    moe = MoeConfig(num_experts=6, top_k=2, intermediate_size=48, renormalize=True, layers=(True,))
    config = ModelConfig(
        architecture="mixtral", vocab_size=64, hidden_size=32, intermediate_size=96, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4), max_model_len=128,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, eos_token_ids=(), bos_token_id=None,
        moe=moe,
    )  # fmt: skip
    torch.manual_seed(rows)
    block = SparseMoeBlock(config)
    for param in block.parameters():
        param.data.normal_(0.0, 0.2)
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        expected = block(x)
        assert prepack_linears(block) == 2  # the router (an nn.Linear) and the experts
        got = block(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if path == "onednn":  # no second copy kept
        assert block.experts.gate_up_proj is None and block.experts.down_proj is None


def test_a_float32_cpu_engine_packs_every_matmul(reference_case):
    model_dir, _, _ = reference_case  # Llama with GQA, and Qwen2 (q/k/v bias)
    model = LLM(str(model_dir), max_num_seqs=2).engine.runner.model
    linears = [module for module in model.modules() if isinstance(module, (nn.Linear, PackedLinear))]
    assert linears and all(isinstance(module, PackedLinear) for module in linears)


def test_a_bfloat16_engine_keeps_plain_weights(llama_dir):
    model = LLM(str(llama_dir), max_num_seqs=2, dtype="bfloat16").engine.runner.model
    assert isinstance(model.lm_head, nn.Linear) and isinstance(model.layers[0].mlp.down_proj, nn.Linear)


def test_a_tied_embedding_keeps_its_rows_and_greedy_is_still_transformers(tmp_path):
    model_dir = write_checkpoint(tmp_path / "tied", LLAMA3_ROPE)
    prompts = random_prompts(4, 5, 120, seed=3)
    expected = transformers_greedy(model_dir, prompts, 24)
    llm = LLM(str(model_dir), max_num_seqs=4)
    model = llm.engine.runner.model
    assert isinstance(model.lm_head, PackedLinear)
    torch.testing.assert_close(dense_weight(model.lm_head), model.embed_tokens.weight.detach(), rtol=0, atol=0)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == expected
