"""Gemma 3, text only (Gemma3ForCausalLM, model_type gemma3_text: the 1B model, or a larger one's language model
saved alone): Gemma 2's layer plus per-head q/k norms, five sliding layers to one global (sliding_window_pattern 6,
unless config.json lists layer_types), the sliding layers' own rotary theta (rope_local_base_freq; transformers 5
writes rope_parameters per layer type), and no soft-capping of the attention scores (transformers' Gemma 3 applies
none whatever attn_logit_softcapping says; tokend computes what transformers does). The multimodal
Gemma3ForConditionalGeneration (model_type gemma3: a vision tower) is not this entry and is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import gemma2
from gpu_runtime.model.config import ModelConfig, rope_of_parameters
from gpu_runtime.model.gemma import SLIDING, Gemma3ForCausalLM
from gpu_runtime.model.gguf_format import GGUFFormat, Hparam
from gpu_runtime.model.registry import Architecture
from gpu_runtime.model.tp_checkpoint import REPLICATED

TP_SPLITS = {**gemma2.TP_SPLITS, "self_attn.q_norm": REPLICATED, "self_attn.k_norm": REPLICATED}

_GLOBAL_THETA, _LOCAL_THETA = 1_000_000.0, 10_000.0  # transformers' Gemma3TextConfig defaults


def _gemma3(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    defaults = {"sliding_window": 4096, "attn_logit_softcapping": None, "final_logit_softcapping": None}
    config = gemma2.gemma_config(raw, config, pattern, defaults)
    layered = raw.get("rope_parameters") or {}
    if layered and all(isinstance(value, dict) for value in layered.values()):  # transformers 5: per layer type
        full, local = layered.get("full_attention") or {}, layered.get("sliding_attention") or {}
    else:  # rope_theta (and rope_scaling: the global layers' linear factor 8 of the 4B and up), rope_local_base_freq
        full = {**(raw.get("rope_scaling") or {}), **layered}
        full.setdefault("rope_theta", raw.get("rope_theta", _GLOBAL_THETA))
        local = {"rope_theta": raw.get("rope_local_base_freq", _LOCAL_THETA)}
    return dataclasses.replace(
        config,
        rope=rope_of_parameters(full, _GLOBAL_THETA),
        local_rope=rope_of_parameters(local, _LOCAL_THETA),
        attn_logit_softcap=None,
    )


def _gemma3_gguf(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp fixes Gemma 3's five-to-one pattern and the local layers' theta unless the file states them (a
    newer converter writes the pattern as one flag per layer, true where the layer slides)."""
    config = gemma2.gguf_config(hparam, config, large_model_layers=62)
    pattern = hparam("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        config["layer_types"] = [SLIDING if slides else "full_attention" for slides in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern)
    return {**config, "rope_local_base_freq": float(hparam("rope.freq_base_swa", _LOCAL_THETA))}


ARCHITECTURE = Architecture(
    name="gemma3_text",
    hf_classes=("Gemma3ForCausalLM",),
    model_class=Gemma3ForCausalLM,
    fused=gemma2.ARCHITECTURE.fused,
    tp_splits=TP_SPLITS,
    adapt_config=_gemma3,
    activations=gemma2.ARCHITECTURE.activations,
    gguf=GGUFFormat(
        names=("gemma3",), layer_names=gemma2.GGUF_LAYER_NAMES, norm_offset=gemma2.GGUF_NORM_OFFSET, config=_gemma3_gguf
    ),  # fmt: skip
)
