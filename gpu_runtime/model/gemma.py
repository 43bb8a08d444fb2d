"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP under Gemma's own layer.

What differs from Llama, as transformers' Gemma2ForCausalLM / Gemma3ForCausalLM compute it:
- RMSNorm scales by (1 + weight) (the checkpoint stores the offset from 1), in float32;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- a norm before and after attention, and before and after the MLP (four per layer);
- the MLP is GeGLU (gelu_pytorch_tanh);
- queries are scaled by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- layers alternate sliding-window and global attention (config.layer_types), each layer's window passed to the
  attention backend in its LayerAttentionOptions; Gemma 3 rotates its sliding layers with their own theta
  (rope_local_base_freq) and norms each query and key head;
- Gemma 2 soft-caps the attention scores and the final logits: cap * tanh(x / cap).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.embedding import unfilled_embedding
from gpu_runtime.model.llama import MLP, Attention
from gpu_runtime.model.qwen3 import QKNormAttention
from gpu_runtime.model.rope import RotaryEmbedding
from gpu_runtime.model.tensor_parallel import TensorParallel, VocabParallelEmbedding, shard_config

SLIDING = "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, back in x's dtype (zeros are the identity)."""

    identity_weight = 0.0  # what a dummy load (load_format "dummy") fills it with

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)


def layer_options(config: ModelConfig, index: int) -> LayerAttentionOptions:
    """Layer `index`'s attention: its scale, its window if it is a sliding layer, the soft-cap if any."""
    sliding = is_sliding(config, index)
    return LayerAttentionOptions(
        scale=config.query_scale if config.query_scale is not None else config.head_dim**-0.5,
        sliding_window=config.sliding_window if sliding else None,
        logit_softcap=config.attn_logit_softcap,
    )


def is_sliding(config: ModelConfig, index: int) -> bool:
    return bool(config.layer_types) and config.layer_types[index] == SLIDING


class GemmaDecoderLayer(nn.Module):
    """Norms on both sides of attention and of the MLP; the residual adds the normed outputs."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int,
                 qk_norm: bool):  # fmt: skip
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.sliding = is_sliding(config, index)
        options = layer_options(config, index)
        self.input_layernorm = GemmaRMSNorm(size, eps)
        if qk_norm:  # Gemma 3: each query and key head normed with Gemma's (1 + w) RMSNorm before RoPE
            self.self_attn = QKNormAttention(config, backend, tp, options, norm=GemmaRMSNorm)
        else:
            self.self_attn = Attention(config, backend, tp, options)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(config, tp)  # GeGLU: config.hidden_act is gelu_pytorch_tanh
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x, rotations, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        rotation = rotations[self.sliding]
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotation, k_pages, v_pages, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(nn.Module):
    """The whole decoder, as LlamaForCausalLM (its docstring says how tensor parallelism and the plan go); Gemma 3's
    per-head q/k norms where `qk_norm` (the Gemma3ForCausalLM subclass)."""

    qk_norm = False

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, dtype: torch.dtype, tp: TensorParallel | None = None
    ):
        super().__init__()
        self.tp = tp
        self.attention_backend = backend
        if tp is not None:
            config = shard_config(config, tp)
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, dtype)
        self.local_rotary = None  # Gemma 2's sliding layers share the global rotation
        if config.local_rope is not None and config.local_rope != config.rope:  # Gemma 3's have their own theta
            self.local_rotary = RotaryEmbedding(config.local_rope, config.head_dim, config.max_model_len, dtype)
        vocab, hidden = config.vocab_size, config.hidden_size
        if tp is None:
            self.embed_tokens = unfilled_embedding(vocab, hidden)
        else:
            self.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
        self.embed_scale = hidden**0.5  # the multiplier, rounded to the model's dtype in forward as transformers does
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, backend, tp, index, self.qk_norm) for index in range(config.num_layers)
        )
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab if tp is None else tp.vocab_shard(vocab)[1], bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_pages, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        rotation = self.rotary.at(positions)
        local = rotation if self.local_rotary is None else self.local_rotary.at(positions)
        rotations = {False: rotation, True: local}  # by layer: is it a sliding one
        for layer, (k_pages, v_pages) in zip(self.layers, kv_pages, strict=True):
            x = layer(x, rotations, k_pages, v_pages, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As LlamaForCausalLM's, soft-capped where the family caps its final logits (each rank caps its own
        vocabulary shard before the gather: the cap is per logit)."""
        logits = self.lm_head(self.norm(hidden)).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits if self.tp is None else self.tp.gather_logits(logits, self.config.vocab_size)


class Gemma3ForCausalLM(GemmaForCausalLM):
    qk_norm = True
