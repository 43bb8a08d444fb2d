"""The rollout's two weight versions: the same tiny Llama shape, drawn from two seeds, so that they differ."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_runtime.default_model import byte_level_tokenizer

# The tests' LLAMA_GQA shape (tests/checkpoints.py), long enough for the long streams: small enough that the run
# measures the serving path (routing, draining, worker start) rather than the matmuls.
TINY_LLAMA = dict(
    vocab_size=258,  # the byte-level tokenizer's 256 bytes plus begin/end of text
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    rope_theta=50000.0,
    max_position_embeddings=4096,
    initializer_range=0.2,  # peaked logits: greedy argmax is not decided by float rounding
    bos_token_id=256,
    eos_token_id=257,
)


def write_tiny_llama(directory: Path, seed: int) -> Path:
    """Saves a random tiny Llama with `save_pretrained`, plus the byte-level tokenizer, into `directory`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.float32)
    model.save_pretrained(directory)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    return directory
