"""A GGUF file's hyperparameters as the config.json and generation_config.json of the transformers checkpoint."""

from __future__ import annotations

import math
from typing import Any

import torch

from gpu_runtime.gguf.reader import GGUFFile
from gpu_runtime.model import registry

# Control tokens that end generation whatever the file's eos id says, as llama.cpp treats them (end of a turn,
# end of a document): a completion prompt ends at the document's end, a chat reply at its turn's.
END_OF_GENERATION_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>"})
_CONTROL = 3  # llama.cpp's token type for special tokens


def gguf_entry(gguf: GGUFFile) -> registry.Architecture:
    """The registry entry that reads this file (Mixtral is told from Llama by its expert tensors); ValueError naming
    the architecture when none does."""
    experts = int(gguf.hparam("expert_count", 0) or 0) > 0
    entry = registry.gguf_architecture(gguf.architecture, experts)
    if entry is None:
        kind = " with experts" if experts else ""
        raise ValueError(f"model: GGUF architecture {gguf.architecture!r}{kind} is not supported; tokend reads "
                         f"{registry.gguf_names()}")  # fmt: skip
    return entry


def hf_config(gguf: GGUFFile, entry: registry.Architecture, rope_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """config.json for the model; `rope_tensors` are the file's rotary tensors by name (weights.ROPE_TENSORS):
    `rope_freqs` (Llama 3.1's scaling), `rope_factors_long`/`_short` (Phi-3's longrope)."""
    hidden = int(_required(gguf, "embedding_length"))
    num_heads = int(_required(gguf, "attention.head_count"))
    head_dim = int(gguf.hparam("attention.key_length", hidden // num_heads))
    rotary_dims = int(gguf.hparam("rope.dimension_count", head_dim))
    if rotary_dims != head_dim and not entry.gguf.partial_rotary:
        raise ValueError(f"model: GGUF rotates {rotary_dims} of {head_dim} head dimensions; tokend rotates all "
                         f"for {gguf.architecture!r}")  # fmt: skip
    scaling = gguf.hparam("rope.scaling.type", "none")
    if scaling not in ("none", "linear", None):
        raise ValueError(f"model: GGUF rope scaling {scaling!r} is not supported (none, linear, or Llama 3's)")
    theta = float(gguf.hparam("rope.freq_base", 10000.0))
    context = int(gguf.hparam("context_length", 2048))
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    config = {
        "architectures": [entry.hf_classes[0]],
        "model_type": entry.name,
        "vocab_size": int(gguf.hparam("vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(_required(gguf, "feed_forward_length")),
        "num_hidden_layers": int(_required(gguf, "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf.hparam("attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": context,
        "rms_norm_eps": float(gguf.hparam("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "attention_bias": "blk.0.attn_q.bias" in gguf.tensor_names(),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names(),
        "bos_token_id": gguf.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(_required(gguf, "rope.scaling.factor"))}
    if rotary_dims != head_dim:
        config["partial_rotary_factor"] = rotary_dims / head_dim
    if "rope_freqs.weight" in rope_tensors:
        config["rope_scaling"] = llama3_rope_scaling(rope_tensors["rope_freqs.weight"], theta, head_dim)
    if "rope_factors_long.weight" in rope_tensors:  # longrope; the attention factor follows from the two lengths
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": rope_tensors["rope_factors_long.weight"].tolist(),
            "short_factor": rope_tensors["rope_factors_short.weight"].tolist(),
        }
        config["original_max_position_embeddings"] = int(_required(gguf, "rope.scaling.original_context_length"))
    return entry.gguf.config(gguf.hparam, config)


def generation_config(gguf: GGUFFile) -> dict[str, Any]:
    """The ids that end generation: the file's eos, end-of-turn and end-of-message ids, and the control tokens
    llama.cpp also stops at."""
    metadata = gguf.metadata
    ids = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind == _CONTROL and text in END_OF_GENERATION_TEXTS:
            ids.append(i)
    eos = list(dict.fromkeys(int(i) for i in ids if i is not None))
    return {
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }


def llama3_rope_scaling(factors: torch.Tensor, theta: float, head_dim: int) -> dict[str, Any]:
    """Llama 3.1's rope_scaling, recognised from the per-frequency factors llama.cpp stores in `rope_freqs`: the
    standard parameters (low 1, high 4, original context 8192) with the largest factor must reproduce them all."""
    factor = float(factors.max())
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = torch.tensor(_llama3_factors(theta, head_dim, scaling), dtype=torch.float32)
    if factors.shape != expected.shape or not torch.allclose(factors.float(), expected, rtol=1e-4):
        raise ValueError("model: GGUF rope_freqs are not Llama 3's standard scaling; tokend cannot reproduce them")
    return scaling


def _llama3_factors(theta: float, head_dim: int, scaling: dict[str, Any]) -> list[float]:
    """The factors llama.cpp's converter writes for these parameters (the same formula transformers applies)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            factors.append(1.0)
        elif wavelength > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def _required(gguf: GGUFFile, key: str) -> Any:
    value = gguf.hparam(key)
    if value is None:
        raise ValueError(f"model: GGUF file {gguf.path} lacks {gguf.architecture}.{key}")
    return value
