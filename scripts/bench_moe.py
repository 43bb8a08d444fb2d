"""The sparse MoE block (gpu_runtime/model/moe.py) against a dense MLP with the same active parameters per token.

A Qwen3-MoE-like layer scaled to a CPU: hidden 1024, 32 experts of width 256, the top 4 per token (1024 active
columns), against a dense SwiGLU MLP of width 1024. At batch 1 both read about the same weights; at batch 32 the
tokens' 128 assignments touch nearly every expert, so the MoE block reads nearly all 32 experts' weights (8x the
dense MLP's) and runs up to 32 small matmul pairs: on a memory-bound CPU its ratio is bounded below by the weights
it reads (printed as `weights_read_ratio`), not by its arithmetic.

Prints JSON: milliseconds per call and per token, each batch size. Usage: .venv/bin/python scripts/bench_moe.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.model.config import ModelConfig, MoeConfig, RopeConfig  # noqa: E402
from gpu_runtime.model.llama import MLP  # noqa: E402
from gpu_runtime.model.moe import SparseMoeBlock  # noqa: E402

HIDDEN, EXPERTS, TOP_K, WIDTH = 1024, 32, 4, 256


def config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen3_moe", vocab_size=1000, hidden_size=HIDDEN, intermediate_size=TOP_K * WIDTH, num_layers=1,
        num_heads=8, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope=RopeConfig(theta=1e4), max_model_len=4096,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False, eos_token_ids=(), bos_token_id=None,
        moe=MoeConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=WIDTH, renormalize=True, layers=(True,)),
    )  # fmt: skip


def milliseconds(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    moe, dense = SparseMoeBlock(config()), MLP(config())
    for module in (moe, dense):
        for param in module.parameters():
            param.normal_(0.0, 0.02)
    rows = []
    for batch in (1, 32):
        x = torch.randn(batch, HIDDEN)
        chosen = torch.topk(moe.gate(x), TOP_K, dim=-1).indices
        touched = int(chosen.unique().numel())
        moe_ms, dense_ms = milliseconds(lambda x=x: moe(x)), milliseconds(lambda x=x: dense(x))
        rows.append({
            "batch": batch, "moe_ms": round(moe_ms, 3), "dense_ms": round(dense_ms, 3),
            "moe_ms_per_token": round(moe_ms / batch, 4), "dense_ms_per_token": round(dense_ms / batch, 4),
            "ratio": round(moe_ms / dense_ms, 2), "experts_touched": touched,
            "weights_read_ratio": round(touched / TOP_K, 2),  # the experts' weights read over the dense MLP's
        })  # fmt: skip
    shape = {
        "hidden": HIDDEN,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "expert_width": WIDTH,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps({"shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
