"""Mistral: Llama's decoder, its context capped at the sliding window (tokend attends over all of it, so within the
window its outputs are exact)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import ModelConfig


def _capped_at_window(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    window = raw.get("sliding_window")  # Mistral windows whenever it has one (no use_sliding_window flag)
    return dataclasses.replace(config, max_model_len=min(config.max_model_len, int(window))) if window else config


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE, name="mistral", hf_classes=("MistralForCausalLM",), adapt_config=_capped_at_window,
    gguf=None,
)  # fmt: skip
