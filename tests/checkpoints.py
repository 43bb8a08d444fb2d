"""Random-weight checkpoints written by transformers itself, the reference the engine must match."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_runtime.default_model import byte_level_tokenizer

VOCAB_SIZE = 258  # the byte-level tokenizer's 256 bytes plus begin/end of text

LLAMA_GQA = {
    "kind": "llama",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # grouped-query attention, 4 query heads per KV head
    "rope_theta": 50000.0,  # not the default 10000
}
LLAMA3_ROPE = {
    "kind": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": True,
}
QWEN2 = {"kind": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2}


def write_checkpoint(directory: Path, spec: dict, seed: int = 0, **overrides) -> Path:
    """Saves a small random model with `save_pretrained`, plus a tokenizer, into `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = {**spec, **overrides}
    kind = spec.pop("kind")
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[kind]
    config = config_class(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.pop("hidden_size", 64),
        intermediate_size=spec.pop("intermediate_size", 160),
        num_hidden_layers=spec.pop("num_hidden_layers", 2),
        max_position_embeddings=spec.pop("max_position_embeddings", 1024),
        # A wide init gives peaked logits, so greedy argmax is not decided by float rounding.
        initializer_range=spec.pop("initializer_range", 0.2),
        bos_token_id=256,
        eos_token_id=257,
        **spec,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    model.save_pretrained(directory)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    return directory
