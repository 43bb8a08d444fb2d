"""Phi-3 (and Phi-3.5-mini, Phi-4-mini): Llama's decoder, with every layer's attention windowed when config.json has
a sliding_window shorter than the context (Phi-3-mini-4k's 2047), as transformers masks it. Its checkpoint already
fuses q/k/v and gate/up, as tokend's parameters do; its longrope and partial rotary are rope.py's."""

from __future__ import annotations

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM
from gpu_runtime.model.tensor_parallel import TensorParallel


def window_options(config: ModelConfig) -> LayerAttentionOptions | None:
    """Every layer's window, or None where it covers the whole context (plain attention: the faster kernels)."""
    window = config.sliding_window
    if window is None or window >= config.max_model_len:
        return None
    return LayerAttentionOptions(scale=config.head_dim**-0.5, sliding_window=window)


class Phi3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int):
        return DecoderLayer(config, Attention(config, backend, tp, window_options(config)), MLP(config, tp))
