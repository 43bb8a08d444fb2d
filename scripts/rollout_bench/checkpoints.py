"""The rollout's two weight versions: the same tiny Llama shape, drawn from two seeds, so that they differ."""

from __future__ import annotations

from pathlib import Path

from bench_engine import write_bench_model

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
    tie_word_embeddings=False,
    initializer_range=0.2,  # peaked logits: greedy argmax is not decided by float rounding
)


def write_tiny_llama(directory: Path, seed: int) -> Path:
    """Saves a random tiny Llama of this seed, plus the byte-level tokenizer, into `directory`."""
    write_bench_model(directory, seed=seed, **TINY_LLAMA)
    return directory
