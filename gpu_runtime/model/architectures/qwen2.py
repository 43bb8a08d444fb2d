"""Qwen2: Llama's decoder with biases on q, k and v (and none on o_proj, whatever attention_bias says)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.gguf_format import GGUFFormat


def _qkv_biases(raw: dict[str, Any], config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, qkv_bias=True, o_bias=False)


ARCHITECTURE = dataclasses.replace(
    llama.ARCHITECTURE, name="qwen2", hf_classes=("Qwen2ForCausalLM",), adapt_config=_qkv_biases,
    gguf=GGUFFormat(names=("qwen2",)),
)  # fmt: skip
