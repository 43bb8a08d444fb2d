"""Phi-3 / Phi-3.5-mini / Phi-4-mini (Phi3ForCausalLM): Llama's layer with the checkpoint's own fused qkv_proj and
gate_up_proj (loaded by name; under tensor parallelism each rank reads its share of every piece), longrope scaling
(short_factor within original_max_position_embeddings, long_factor past it, cos/sin scaled by the attention factor),
a partial rotary (partial_rotary_factor: Phi-4-mini rotates 96 of 128), and a sliding window over every layer."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import ModelConfig, RopeConfig
from gpu_runtime.model.gguf_format import GGUFFormat, Hparam
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.model.registry import Architecture
from gpu_runtime.model.tp_checkpoint import fused_column_parallel

_LONGROPE = ("longrope", "su", "yarn")  # transformers' Phi3Config reads the older names as longrope


def _rope(raw: dict[str, Any], config: ModelConfig) -> RopeConfig:
    params = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope = dataclasses.replace(config.rope, partial_rotary_factor=partial)
    if rope_type not in _LONGROPE:
        return rope
    original = int(params.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
    factor = params.get("factor") or int(raw.get("max_position_embeddings", original)) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:  # the LongRoPE paper's, as transformers computes it
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    pairs = int(config.head_dim * partial) // 2
    short, long = tuple(map(float, params["short_factor"])), tuple(map(float, params["long_factor"]))
    if len(short) != pairs or len(long) != pairs:
        raise ValueError(f"config.json: rope_scaling short_factor/long_factor must have {pairs} values each")
    return dataclasses.replace(
        rope, rope_type="longrope", original_max_position_embeddings=original, short_factor=short, long_factor=long,
        attention_factor=float(attention_factor),
    )  # fmt: skip


def _phi3(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    window = raw.get("sliding_window")
    return dataclasses.replace(
        config,
        rope=_rope(raw, config),
        sliding_window=int(window) if window else None,
        qkv_bias=False,  # Phi-3 has no biases (its config.json has no attention_bias)
        o_bias=False,
    )


def _qkv_rows(config: ModelConfig) -> tuple[int, int, int]:
    return llama.q_rows(config), llama.kv_rows(config), llama.kv_rows(config)


# Llama's, with the checkpoint's fused tensors in place of the pieces Llama's checkpoints store apart.
_SEPARATE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
TP_SPLITS = {
    **{module: split for module, split in llama.TP_SPLITS.items() if module not in _SEPARATE},
    "self_attn.qkv_proj": fused_column_parallel(_qkv_rows),
    "mlp.gate_up_proj": fused_column_parallel(lambda config: (llama.mlp_width(config),) * 2),
}


def _from_gguf(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    window = hparam("attention.sliding_window", 0)  # the converter writes 0 for none (Phi-4-mini)
    return {**config, "sliding_window": int(window) or None}


# llama.cpp's names for the checkpoint's own fused tensors (its ffn_up is Phi-3's gate_up_proj, gate rows first).
GGUF_LAYER_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}

ARCHITECTURE = Architecture(
    name="phi3",
    hf_classes=("Phi3ForCausalLM",),
    model_class=LlamaForCausalLM,  # its window, if any, is Llama's decoder's (llama.window_options)
    fused=(),  # the checkpoint's qkv_proj and gate_up_proj are the parameters themselves
    tp_splits=TP_SPLITS,
    adapt_config=_phi3,
    rope_types=("default", "longrope"),
    gguf=GGUFFormat(names=("phi3",), layer_names=GGUF_LAYER_NAMES, partial_rotary=True, config=_from_gguf),
)
