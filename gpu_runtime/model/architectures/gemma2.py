"""Gemma 2: Gemma's decoder (gemma.py) with sliding-window layers alternating with global ones (even layers slide,
unless config.json lists layer_types), attention and final-logit soft-capping, and one rotary theta."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.gemma import SLIDING, GemmaForCausalLM
from gpu_runtime.model.gguf_format import GGUFFormat, Hparam
from gpu_runtime.model.registry import Architecture
from gpu_runtime.model.tp_checkpoint import REPLICATED

GELU_TANH = "gelu_pytorch_tanh"

# Llama's, plus the two norms around the MLP.
TP_SPLITS = {
    **llama.TP_SPLITS,
    "pre_feedforward_layernorm": REPLICATED,
    "post_feedforward_layernorm": REPLICATED,
}


def refuse_bidirectional(raw: dict[str, Any]) -> None:
    if raw.get("use_bidirectional_attention"):  # EmbeddingGemma: an encoder, not a causal LM
        raise ValueError("config.json: use_bidirectional_attention=true is not supported (tokend decodes causally)")


def layer_types(raw: dict[str, Any], num_layers: int, pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, else every `pattern`-th layer global and the others sliding (transformers' rule)."""
    listed = raw.get("layer_types")
    if listed:
        if len(listed) != num_layers or set(listed) - {SLIDING, "full_attention"}:
            raise ValueError(f"config.json: layer_types={listed!r} is not {num_layers} of sliding/full_attention")
        return tuple(listed)
    return tuple(SLIDING if (i + 1) % pattern else "full_attention" for i in range(num_layers))


def gemma_config(raw: dict[str, Any], config: ModelConfig, pattern: int, defaults: dict[str, Any]) -> ModelConfig:
    """What Gemma 2 and 3 read alike; `defaults`: their transformers config class's for keys config.json lacks."""
    refuse_bidirectional(raw)
    types = layer_types(raw, config.num_layers, pattern)
    window = raw.get("sliding_window", defaults["sliding_window"])
    if SLIDING in types and not window:
        raise ValueError(f"config.json: sliding_window={window!r}, but layer_types has {SLIDING} layers")
    scalar = raw.get("query_pre_attn_scalar", 256)
    return dataclasses.replace(
        config,
        hidden_act=str(raw.get("hidden_activation") or raw.get("hidden_act") or GELU_TANH),
        layer_types=types,
        sliding_window=int(window) if SLIDING in types else None,
        query_scale=float(scalar) ** -0.5,
        attn_logit_softcap=_cap(raw.get("attn_logit_softcapping", defaults["attn_logit_softcapping"])),
        final_logit_softcap=_cap(raw.get("final_logit_softcapping", defaults["final_logit_softcapping"])),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_bias=bool(raw.get("attention_bias", False)),
    )


def _cap(value) -> float | None:
    return float(value) if value else None


def _gemma2(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    defaults = {"sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    return gemma_config(raw, config, pattern=2, defaults=defaults)


# llama.cpp's names for the four norms around attention and the MLP (its ffn_norm is the pre-MLP norm here).
GGUF_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_NORM_OFFSET = 1.0  # the converter stores 1 + w, the factor Gemma's RMSNorm multiplies by


def gguf_config(hparam: Hparam, config: dict[str, Any], large_model_layers: int) -> dict[str, Any]:
    """What Gemma 2 and 3 files say alike. The query scale is not in the file: llama.cpp takes 1/sqrt(head_dim),
    except for the 27B models (query_pre_attn_scalar = hidden / heads), which it tells by their layer count; the
    same rule is applied here."""
    large = config["num_hidden_layers"] == large_model_layers
    scalar = config["hidden_size"] // config["num_attention_heads"] if large else config["head_dim"]
    return {
        **config,
        "hidden_act": GELU_TANH,
        "hidden_activation": GELU_TANH,
        "query_pre_attn_scalar": scalar,
        "sliding_window": hparam("attention.sliding_window", None),
        "final_logit_softcapping": hparam("final_logit_softcapping", None),
    }


def _gemma2_gguf(hparam: Hparam, config: dict[str, Any]) -> dict[str, Any]:
    config = gguf_config(hparam, config, large_model_layers=46)
    return {**config, "attn_logit_softcapping": hparam("attn_logit_softcapping", None)}


ARCHITECTURE = Architecture(
    name="gemma2",
    hf_classes=("Gemma2ForCausalLM",),
    model_class=GemmaForCausalLM,
    fused=llama.FUSED,
    tp_splits=TP_SPLITS,
    adapt_config=_gemma2,
    activations=(GELU_TANH,),
    gguf=GGUFFormat(names=("gemma2",), layer_names=GGUF_LAYER_NAMES, norm_offset=GGUF_NORM_OFFSET, config=_gemma2_gguf),
)
