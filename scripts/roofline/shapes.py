"""Model shapes for the roofline, and random checkpoints of them (tokend's loader reads them like any other)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_runtime.default_model import byte_level_tokenizer

SHAPES = {
    # For the CPU dry run of the GPU check: seconds, not minutes.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # The decode issue's workload: a ~32M-parameter Llama.
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192),
    # Llama-3-8B's shape, for a GPU box (random weights made on the device: --load-format dummy).
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}  # fmt: skip

# Shapes whose weights are not written to disk: the engine draws them on its device.
DUMMY_WEIGHT_SHAPES = {"8b"}


def write_random_checkpoint(directory: Path, shape: dict, dtype: torch.dtype, with_weights: bool = True) -> Path:
    """config.json, a byte-level tokenizer and (unless the engine will draw them) random weights."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **shape,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    if with_weights:
        save_file(_random_weights(config, dtype), str(directory / "model.safetensors"))
    return directory


def _random_weights(config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (inter, hidden),
            prefix + "mlp.up_proj.weight": (inter, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inter),
        }
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, size in shapes.items():
        weight = torch.ones(size) if name.endswith("norm.weight") else torch.randn(size, generator=generator) * 0.02
        weights[name] = weight.to(dtype)
    return weights
