"""The sparse MoE block (gpu_runtime/model/moe.py) against a dense MLP with the same active parameters per token.

A Qwen3-MoE-like layer scaled to a CPU: hidden 1024, 32 experts of width 256, the top 4 per token (1024 active
columns), against a dense SwiGLU MLP of width 1024, both with their weights packed for oneDNN as the engine packs
them on a CPU. At batch 1 both read about the same weights; at batch 32 the tokens' 128 assignments touch nearly
every expert, so the MoE block reads nearly all 32 experts' weights (8x the dense MLP's) and runs up to 32 small
matmul pairs: on a memory-bound CPU its ratio is bounded below by the weights it reads (printed as
`weights_read_ratio`), not by its arithmetic.

The floor is measured, not assumed: the machine's read bandwidth (summing a 512 MiB tensor, best of five) gives
the least time reading the touched experts' weights can take (`moe_floor_ms`), and `moe_over_floor` says how close
the block is to it; the dense MLP's floor is the larger of its bytes over that bandwidth and its FLOPs over the
measured matmul peak (`dense_floor_ms`). `floor_ratio` is the least MoE/dense ratio those floors allow.

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
from gpu_runtime.model.cpu_weights import prepack_linears  # noqa: E402
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


def read_bandwidth() -> float:
    """Bytes per second this machine reads from memory (a 512 MiB float32 sum, best of five)."""
    data = torch.ones(128 << 20)
    best = min(milliseconds(data.sum, repeats=1) for _ in range(5))
    return data.numel() * 4 / (best / 1e3)


def matmul_peak() -> float:
    """FLOPs per second of a large float32 matmul (1024 x 4096 by 4096 x 1024, cache-friendly)."""
    a, b = torch.randn(1024, 4096), torch.randn(4096, 1024)
    return 2 * 1024 * 4096 * 1024 / (milliseconds(lambda: a @ b, repeats=5) / 1e3)


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    moe, dense = SparseMoeBlock(config()), MLP(config())
    for module in (moe, dense):
        for param in module.parameters():
            param.normal_(0.0, 0.02)
        prepack_linears(module)  # as the engine does on a CPU in float32: dense linears and experts alike
    bandwidth, peak = read_bandwidth(), matmul_peak()
    expert_bytes = 3 * WIDTH * HIDDEN * 4  # gate, up and down, float32
    dense_bytes = 3 * TOP_K * WIDTH * HIDDEN * 4
    rows = []
    for batch in (1, 32):
        x = torch.randn(batch, HIDDEN)
        chosen = torch.topk(moe.gate(x), TOP_K, dim=-1).indices
        touched = int(chosen.unique().numel())
        moe_ms, dense_ms = milliseconds(lambda x=x: moe(x)), milliseconds(lambda x=x: dense(x))
        moe_floor_ms = touched * expert_bytes / bandwidth * 1e3
        dense_floor_ms = max(dense_bytes / bandwidth, 2 * batch * dense_bytes / 4 / peak) * 1e3
        rows.append({
            "batch": batch, "moe_ms": round(moe_ms, 3), "dense_ms": round(dense_ms, 3),
            "moe_ms_per_token": round(moe_ms / batch, 4), "dense_ms_per_token": round(dense_ms / batch, 4),
            "ratio": round(moe_ms / dense_ms, 2), "experts_touched": touched,
            "weights_read_ratio": round(touched / TOP_K, 2),  # the experts' weights read over the dense MLP's
            "moe_floor_ms": round(moe_floor_ms, 3), "moe_over_floor": round(moe_ms / moe_floor_ms, 2),
            "dense_floor_ms": round(dense_floor_ms, 3), "floor_ratio": round(moe_floor_ms / dense_floor_ms, 2),
        })  # fmt: skip
    shape = {
        "hidden": HIDDEN,
        "experts": EXPERTS,
        "top_k": TOP_K,
        "expert_width": WIDTH,
        "threads": torch.get_num_threads(),
    }
    machine = {"read_gb_per_s": round(bandwidth / 1e9, 2), "matmul_gflops": round(peak / 1e9, 1)}
    print(json.dumps({"shape": shape, "machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
