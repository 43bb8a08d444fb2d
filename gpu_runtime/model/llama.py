"""A Llama-family decoder (Llama, Mistral, Qwen2) over a flattened token batch and a paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        if input_dtype == torch.float32:  # one fused kernel, the same float32 arithmetic as the steps below
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with fused q/k/v projections; K/V live in the layer's page pool."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.backend = backend

    def forward(self, x, rotation, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # Queries and keys rotated together, as one [tokens, heads + kv_heads, head_dim] block.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, *rotation)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, k_pages, v_pages, meta)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rotation, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, k_pages, v_pages, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The whole decoder; parameter names follow transformers, except the fused projections."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_pages: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (k_pages, v_pages)
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden_size], before the final norm
        x = self.embed_tokens(input_ids)
        rotation = self.rotary.at(positions)  # the same rows for every layer
        for layer, (k_pages, v_pages) in zip(self.layers, kv_pages, strict=True):
            x = layer(x, rotation, k_pages, v_pages, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits for the rows that sample; the final norm is per row, so it runs only on them."""
        return self.lm_head(self.norm(hidden)).float()
