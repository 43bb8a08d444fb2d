"""Qwen3's decoder: Llama's, with each query and key head RMS-normalised (over head_dim, one weight shared by the
heads) before RoPE, and no q/k/v bias (attention_bias, as Llama reads it)."""

from __future__ import annotations

import torch

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from gpu_runtime.model.tensor_parallel import TensorParallel


class QKNormAttention(Attention):
    """Attention whose queries and keys are normalised per head before RoPE (Qwen3's q_norm and k_norm). Under
    tensor parallelism each rank norms its own heads with the whole (head_dim-long) weights: they are replicated."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        options: LayerAttentionOptions | None = None,
        norm: type[torch.nn.Module] = RMSNorm,  # Gemma 3 norms with its (1 + w) RMSNorm
    ):
        super().__init__(config, backend, tp, options)
        self.q_norm = norm(config.head_dim, config.rms_norm_eps)
        self.k_norm = norm(config.head_dim, config.rms_norm_eps)

    def normed(self, qk: torch.Tensor) -> torch.Tensor:
        q = self.q_norm(qk[:, : self.num_heads])
        k = self.k_norm(qk[:, self.num_heads :])
        return torch.cat((q, k), dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int):
        return DecoderLayer(config, QKNormAttention(config, backend, tp), MLP(config, tp))
