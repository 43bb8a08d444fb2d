"""A Llama-family decoder (Llama, Mistral, Qwen2, Phi-3) over a flattened token batch and a paged KV cache; with a
TensorParallel, one rank's shard of it (the split: tensor_parallel.py). Its pieces are what the other decoders here
are built from: Qwen3 (qwen3.py) adds per-head q/k norms, the MoE families (moe.py) swap the MLP of some layers, Gemma
(gemma.py) reuses the attention and MLP under its own norms."""

from __future__ import annotations

import torch
from torch import nn

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.kv_cache.kv_groups import KVLayout
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.embedding import unfilled_embedding
from gpu_runtime.model.rope import RotaryEmbedding, apply_rotary
from gpu_runtime.model.tensor_parallel import TensorParallel, VocabParallelEmbedding, holds_row_bias, shard_config

# The gated MLP's activations by config.json name (ModelConfig.hidden_act), as transformers' ACT2FN computes them.
ACTIVATIONS = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),  # Gemma's GeGLU
}


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
    """Grouped-query self-attention with fused q/k/v projections; K/V live in the layer's page pool. Under tensor
    parallelism `config` is the rank's view: its heads only, o_proj's partial sums added over the ranks."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        tp: TensorParallel | None = None,
        options: LayerAttentionOptions | None = None,  # this layer's, where its family's layers differ (Gemma)
    ):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias and holds_row_bias(tp))
        # Every layer alike, as Llama's are, unless the family says otherwise.
        self.options = options or LayerAttentionOptions.default(config.head_dim)
        backend.check_options(self.options)
        self.backend = backend
        self.tp = tp
        self.kv_group = 0  # whose block table holds its pages (place_kv_groups; one group unless the model is hybrid)

    def forward(self, x, rotation, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # Queries and keys rotated together, as one [tokens, heads + kv_heads, head_dim] block.
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(self.normed(qk), *rotation)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        meta = meta.of_group(self.kv_group)
        out = self.o_proj(self.backend.forward(q, k, v, k_pages, v_pages, meta, self.options).flatten(1))
        return out if self.tp is None else self.tp.all_reduce(out)

    def normed(self, qk: torch.Tensor) -> torch.Tensor:
        """The [tokens, heads + kv_heads, head_dim] queries and keys before RoPE: Llama's as they are (QKNormAttention
        normalises each head)."""
        return qk


def window_options(config: ModelConfig) -> LayerAttentionOptions | None:
    """Every layer's options where config.sliding_window windows all of them (Mistral 7B v0.1, Phi-3-mini-4k; a
    family whose layers differ, Gemma's, builds its own per layer); None where the window covers the whole context:
    plain attention, which the fastest kernels run."""
    window = config.sliding_window
    if window is None or window >= config.max_model_len:
        return None
    return LayerAttentionOptions(scale=config.head_dim**-0.5, sliding_window=window)


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention modules, in layer order."""
    return [module for module in model.modules() if isinstance(module, Attention)]


def layer_windows(model: nn.Module) -> list[int | None]:
    """Each layer's sliding window (None: it reads the whole context), in layer order."""
    return [module.options.sliding_window for module in attention_layers(model)]


def place_kv_groups(model: nn.Module, layout: KVLayout) -> None:
    """Tells each attention layer its KV group under `layout` (which block table its pages are in)."""
    for module, group in zip(attention_layers(model), layout.group_of_layer(), strict=True):
        module.kv_group = group


class MLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU with Gemma's activation) with the gate and up projections fused into
    one matmul."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        down_bias = config.mlp_bias and holds_row_bias(tp)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=down_bias)
        self.act = ACTIVATIONS[config.hidden_act]
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        out = self.down_proj(self.act(gate) * up)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the MLP (a dense one, or a family's own: an MoE block)."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module, mlp_name: str = "mlp"):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Under the checkpoint's name for it, so that its tensors map by name (Mixtral's is block_sparse_moe).
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)

    def forward(self, x, rotation, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotation, k_pages, v_pages, meta)
        return x + self._modules[self.mlp_name](self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """The whole decoder; parameter names follow transformers, except the fused projections.

    With `tp`, this rank's shard of it: `config` stays the whole model's, `self.config` is the rank's view
    (shard_config), and every rank must run every forward and compute_logits with the same inputs. Before each
    forward the caller runs `attention_backend.plan` on the step's metadata (ModelRunner does)."""

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
        vocab, hidden = config.vocab_size, config.hidden_size
        if tp is None:
            self.embed_tokens = unfilled_embedding(vocab, hidden)
        else:
            self.embed_tokens = VocabParallelEmbedding(vocab, hidden, tp)
        self.layers = nn.ModuleList(self.make_layer(config, backend, tp, index) for index in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, vocab if tp is None else tp.vocab_shard(vocab)[1], bias=False)
        self.tie_weights()

    def make_layer(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel | None, index: int):
        """Layer `index` (`config` the rank's view): where a family built on this decoder differs (qwen3.py, moe.py)."""
        return DecoderLayer(config, Attention(config, backend, tp, window_options(config)), MLP(config, tp))

    def tie_weights(self) -> None:
        """lm_head shares the embedding table where the checkpoint says so (again after `to_empty`, which unties)."""
        if self.config.tie_word_embeddings:
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 [rows, vocab_size] logits for the rows that sample; the final norm is per row, so it runs only on
        them. Under tensor parallelism rank 0 gets them all, gathered from the ranks' shards; the others get None."""
        logits = self.lm_head(self.norm(hidden)).float()
        return logits if self.tp is None else self.tp.gather_logits(logits, self.config.vocab_size)
