"""Mistral: Llama's decoder, every layer attending over the last `sliding_window` positions where config.json sets one
shorter than the context (Mistral 7B v0.1: 4096 of 32768), as transformers masks it; pages behind the window are
given back as a sequence moves on (KVCacheManager.window). v0.2 and later have no window."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import ModelConfig


def _windowed(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    window = raw.get("sliding_window")  # Mistral windows whenever it has one (no use_sliding_window flag)
    return dataclasses.replace(config, sliding_window=int(window)) if window else config


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE, name="mistral", hf_classes=("MistralForCausalLM",), adapt_config=_windowed,
    gguf=None,
)  # fmt: skip
