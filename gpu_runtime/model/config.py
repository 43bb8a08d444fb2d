"""Reads a Hugging Face config.json (and generation_config.json) into one frozen ModelConfig: the fields every
architecture reads alike here, then its own (its registry entry's adapt_config)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_runtime.model import registry


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters; `rope_type` is "default", "linear" (frequencies divided by `factor`), "llama3",
    or "longrope" (Phi-3's: frequencies divided by short_factor up to original_max_position_embeddings, long_factor
    past it, cos and sin scaled by attention_factor). Which types an architecture runs: its registry entry's
    rope_types."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    partial_rotary_factor: float = 1.0  # the share of each head's dimensions rotated (the first ones; Phi-4-mini)


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """A sparse Mixture-of-Experts MLP: a router picks `top_k` of `num_experts` gated MLPs for each token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k softmax weights divided by their sum (Mixtral always; Qwen3-MoE norm_topk_prob)
    layers: tuple[bool, ...]  # per layer: sparse (True) or the dense MLP of `intermediate_size` (False)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family decoder, whatever architecture name its checkpoint carries."""

    architecture: str  # its model registry entry's name
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # What only some families have; each one's adapt_config sets its own (the defaults are Llama's).
    hidden_act: str = "silu"  # the gated MLP's activation (its architecture's `activations` list what it runs)
    moe: MoeConfig | None = None  # the sparse expert layers, for a Mixture-of-Experts family
    # Per layer "full_attention" or "sliding_attention" (Gemma's interleaving); () is every layer alike.
    layer_types: tuple[str, ...] = ()
    # The window of the "sliding_attention" layers; with no layer_types, of every layer (Mistral 7B v0.1, Phi-3).
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None  # the sliding layers' rotary, where it is not `rope` (Gemma 3)
    query_scale: float | None = None  # multiplies q.k (Gemma's query_pre_attn_scalar ** -0.5); None: 1/sqrt(d)
    attn_logit_softcap: float | None = None  # scores become cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits likewise, after lm_head (Gemma 2)
    # False for a base model's checkpoint (config.json names "Qwen3Model", not "Qwen3ForCausalLM": what
    # sentence-transformers saves): it has no lm_head, so it serves embeddings only.
    generates: bool = True

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V that one cached token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _is_base_model(hf_classes: list[str]) -> bool:
    """Whether config.json names only transformers' base classes ("LlamaModel"): the decoder without its head."""
    return bool(hf_classes) and all(isinstance(c, str) and c.endswith("Model") for c in hf_classes)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _architecture_of(raw: dict[str, Any]) -> registry.Architecture:
    names = raw.get("architectures") or []
    model_type = raw.get("model_type")
    entry = registry.architecture_of(names, model_type)
    if entry is None:
        raise ValueError(
            f"config.json: architectures={names!r} model_type={model_type!r} is not supported; "
            f"tokend serves {registry.hf_class_names()}"
        )
    return entry


def _rope_of(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints use `rope_theta` + `rope_scaling`. A family
    # whose layers differ keeps one set per layer type (Gemma 3): the global layers' is the model's `rope` here,
    # and its adapt_config reads the others (rope_of_parameters).
    params = dict(raw.get("rope_scaling") or {})
    layered = raw.get("rope_parameters") or {}
    if layered and all(isinstance(value, dict) for value in layered.values()):
        layered = layered.get("full_attention") or {}
    params.update(layered)
    return rope_of_parameters(params, float(raw.get("rope_theta", 10000.0)))


def rope_of_parameters(params: dict[str, Any], default_theta: float) -> RopeConfig:
    """The RopeConfig of one set of rotary parameters (rope_parameters' or rope_scaling's keys)."""
    theta = float(params.get("rope_theta", default_theta))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=float(params["factor"]))
    if rope_type != "llama3":
        # Refused after the architecture's adapt_config, unless it read the rope itself (Phi-3's longrope).
        return RopeConfig(theta=theta, rope_type=str(rope_type))
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is authoritative (Llama 3 lists several stop ids there).
    value = generation.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _max_model_len(raw: dict[str, Any]) -> int:
    max_len = int(raw.get("max_position_embeddings", 2048))
    # The model attends over its whole context; capping the context at the window keeps outputs exact.
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window", False) and window:
        max_len = min(max_len, int(window))
    return max_len


def load_capped_model_config(model_dir: str | Path, max_model_len: int | None) -> ModelConfig:
    """load_model_config, its context capped at `max_model_len` (the engine's flag) when that is set."""
    config = load_model_config(model_dir)
    if max_model_len:
        config = dataclasses.replace(config, max_model_len=min(max_model_len, config.max_model_len))
    return config


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Parses `model_dir`/config.json and generation_config.json; raises ValueError naming a bad key."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model: {model_dir} has no config.json")
    raw = _read_json(config_path)
    generation = _read_json(model_dir / "generation_config.json")
    architecture = _architecture_of(raw)
    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    attention_bias = bool(raw.get("attention_bias", False))
    config = ModelConfig(
        architecture=architecture.name,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_of(raw),
        max_model_len=_max_model_len(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias,  # Llama's attention_bias covers q/k/v and o_proj alike
        o_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=_eos_ids(raw, generation),
        bos_token_id=raw.get("bos_token_id"),
        hidden_act=str(raw.get("hidden_act", "silu")),
        generates=not _is_base_model(raw.get("architectures") or []),
    )
    config = architecture.adapt_config(raw, config)
    for rope in (config.rope, config.local_rope):
        if rope is not None and rope.rope_type not in architecture.rope_types:
            supported = ", ".join(architecture.rope_types)
            raise ValueError(f"config.json: rope_scaling.rope_type={rope.rope_type!r} is not supported ({supported})")
    if config.hidden_act not in architecture.activations:
        supported = ", ".join(architecture.activations)
        raise ValueError(f"config.json: hidden_act={config.hidden_act!r} is not supported ({supported})")
    return config
