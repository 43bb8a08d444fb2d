"""Qwen3 (dense): Llama's checkpoint layout plus each layer's q_norm and k_norm; head_dim is config.json's own (not
hidden_size / heads: Qwen3-8B's 4096 / 32 would give 128, its head_dim is 128 too, but Qwen3-0.6B's is 128 against
1024 / 16 = 64)."""

from __future__ import annotations

import dataclasses

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.gguf_format import GGUFFormat
from gpu_runtime.model.qwen3 import Qwen3ForCausalLM
from gpu_runtime.model.tp_checkpoint import REPLICATED

# The per-head norms are head_dim long, the same for every head: each rank holds them whole.
TP_SPLITS = {**llama.TP_SPLITS, "self_attn.q_norm": REPLICATED, "self_attn.k_norm": REPLICATED}

ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE, name="qwen3", hf_classes=("Qwen3ForCausalLM",), model_class=Qwen3ForCausalLM,
    tp_splits=TP_SPLITS, gguf=GGUFFormat(names=("qwen3",)),
)  # fmt: skip
