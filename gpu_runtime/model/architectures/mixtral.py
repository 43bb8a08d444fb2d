"""Mixtral: Mistral's attention, every layer's MLP a sparse MoE block (moe.py) of num_local_experts experts, the top
num_experts_per_tok weighted by their softmax renormalised. The checkpoint stores each expert's w1 (gate), w3 (up) and
w2 (down) apart; they are stacked per layer as they load."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama, mistral
from gpu_runtime.model.config import ModelConfig, MoeConfig
from gpu_runtime.model.gguf_format import GGUFFormat, Hparam
from gpu_runtime.model.moe import MixtralForCausalLM
from gpu_runtime.model.registry import Architecture, ExpertParameter
from gpu_runtime.model.tp_checkpoint import REPLICATED, column_parallel, row_parallel


def expert_width(config: ModelConfig) -> int:
    return config.moe.intermediate_size


def _sparse_layers(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    config = mistral.ARCHITECTURE.adapt_config(raw, config)  # its sliding window, if any
    moe = MoeConfig(
        num_experts=int(raw["num_local_experts"]),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=config.intermediate_size,
        renormalize=True,
        layers=(True,) * config.num_layers,
    )
    return dataclasses.replace(config, moe=moe)


EXPERTS = (
    ExpertParameter(
        "block_sparse_moe.experts.gate_up_proj",
        ("block_sparse_moe.experts.*.w1", "block_sparse_moe.experts.*.w3"),
        lambda config: (expert_width(config),) * 2,
    ),
    ExpertParameter(
        "block_sparse_moe.experts.down_proj", ("block_sparse_moe.experts.*.w2",), lambda config: (config.hidden_size,)
    ),  # fmt: skip
)

# Every expert split the Megatron way: gate (w1) and up (w3) by rows, down (w2) by columns; the router whole.
_DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TP_SPLITS = {
    **{module: split for module, split in llama.TP_SPLITS.items() if module not in _DENSE_MLP},
    "block_sparse_moe.gate": REPLICATED,
    "block_sparse_moe.experts.*.w1": column_parallel(expert_width),
    "block_sparse_moe.experts.*.w3": column_parallel(expert_width),
    "block_sparse_moe.experts.*.w2": row_parallel(expert_width),
}

# llama.cpp writes Mixtral as "llama" with merged expert tensors (and llama.expert_count set).
GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.*.w1",
    "ffn_up_exps": "block_sparse_moe.experts.*.w3",
    "ffn_down_exps": "block_sparse_moe.experts.*.w2",
}


def _from_gguf(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    return {
        **config,
        "num_local_experts": int(hparam("expert_count", 0)),
        "num_experts_per_tok": int(hparam("expert_used_count", 0)),
    }


ARCHITECTURE = Architecture(
    name="mixtral",
    hf_classes=("MixtralForCausalLM",),
    model_class=MixtralForCausalLM,
    fused=llama.FUSED[:1],  # q/k/v; there is no dense MLP
    tp_splits=TP_SPLITS,
    adapt_config=_sparse_layers,
    experts=EXPERTS,
    gguf=GGUFFormat(
        names=("llama",), qk_interleaved=True, experts=True, layer_names=GGUF_LAYER_NAMES, config=_from_gguf
    ),  # fmt: skip
)
