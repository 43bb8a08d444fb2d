"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention; layer i's MLP is a sparse MoE block (moe.py) of
num_experts experts of moe_intermediate_size when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers,
else a dense MLP of intermediate_size. The top-k softmax weights are renormalised only if norm_topk_prob."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama, qwen3
from gpu_runtime.model.config import ModelConfig, MoeConfig
from gpu_runtime.model.gguf_format import GGUFFormat, Hparam
from gpu_runtime.model.moe import Qwen3MoeForCausalLM
from gpu_runtime.model.registry import Architecture, ExpertParameter
from gpu_runtime.model.tp_checkpoint import REPLICATED, column_parallel, row_parallel


def expert_width(config: ModelConfig) -> int:
    return config.moe.intermediate_size


def _sparse_layers(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    # transformers writes num_experts as num_local_experts (its attribute map); the Qwen checkpoints say num_experts.
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = {int(i) for i in raw.get("mlp_only_layers") or ()}
    layers = tuple(num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(config.num_layers))
    if not any(layers):
        return config  # every layer dense: Qwen3's decoder in all but name
    moe = MoeConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        layers=layers,
    )
    return dataclasses.replace(config, moe=moe)


EXPERTS = (
    ExpertParameter(
        "mlp.experts.gate_up_proj",
        ("mlp.experts.*.gate_proj", "mlp.experts.*.up_proj"),
        lambda config: (expert_width(config),) * 2,
    ),
    ExpertParameter("mlp.experts.down_proj", ("mlp.experts.*.down_proj",), lambda config: (config.hidden_size,)),
)

# Qwen3's (the dense layers' MLP included), plus the router whole and every expert split the Megatron way.
TP_SPLITS = {
    **qwen3.TP_SPLITS,
    "mlp.gate": REPLICATED,
    "mlp.experts.*.gate_proj": column_parallel(expert_width),
    "mlp.experts.*.up_proj": column_parallel(expert_width),
    "mlp.experts.*.down_proj": row_parallel(expert_width),
}

GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj",
    "ffn_down_exps": "mlp.experts.*.down_proj",
}


def _from_gguf(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's qwen3moe has every layer sparse and always renormalises the top-k weights (as Qwen3-30B-A3B and
    235B-A22B do); the file does not record those settings."""
    return {
        **config,
        "num_experts": int(hparam("expert_count", 0)),
        "num_experts_per_tok": int(hparam("expert_used_count", 0)),
        "moe_intermediate_size": int(hparam("expert_feed_forward_length", config["intermediate_size"])),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


ARCHITECTURE = Architecture(
    name="qwen3_moe",
    hf_classes=("Qwen3MoeForCausalLM",),
    model_class=Qwen3MoeForCausalLM,
    fused=llama.FUSED,
    tp_splits=TP_SPLITS,
    adapt_config=_sparse_layers,
    experts=EXPERTS,
    gguf=GGUFFormat(names=("qwen3moe",), experts=True, layer_names=GGUF_LAYER_NAMES, config=_from_gguf),
)
