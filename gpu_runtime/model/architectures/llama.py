"""Llama (and the base every Llama-shaped family here reuses): its checkpoint's names and its tensor-parallel split."""

from __future__ import annotations

from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.gguf_format import GGUFFormat
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.model.registry import Architecture, FusedParameter
from gpu_runtime.model.tp_checkpoint import (
    NOT_LOADED,
    REPLICATED,
    VOCAB_PARALLEL,
    column_parallel,
    row_parallel,
)


def q_rows(config: ModelConfig) -> int:
    return config.num_heads * config.head_dim


def kv_rows(config: ModelConfig) -> int:
    return config.num_kv_heads * config.head_dim


def mlp_width(config: ModelConfig) -> int:
    return config.intermediate_size


# q/k/v and gate/up each run as one matmul: their checkpoint tensors are stacked into one parameter at load.
FUSED = (
    FusedParameter(
        "self_attn.qkv_proj",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        lambda config: (q_rows(config), kv_rows(config), kv_rows(config)),
    ),
    FusedParameter("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj"), lambda config: (mlp_width(config),) * 2),
)

TP_SPLITS = {
    "model.embed_tokens": VOCAB_PARALLEL,
    "lm_head": VOCAB_PARALLEL,
    "model.norm": REPLICATED,
    "input_layernorm": REPLICATED,
    "post_attention_layernorm": REPLICATED,
    "self_attn.q_proj": column_parallel(q_rows),
    "self_attn.k_proj": column_parallel(kv_rows),
    "self_attn.v_proj": column_parallel(kv_rows),
    "self_attn.o_proj": row_parallel(q_rows),
    "mlp.gate_proj": column_parallel(mlp_width),
    "mlp.up_proj": column_parallel(mlp_width),
    "mlp.down_proj": row_parallel(mlp_width),
    # Older checkpoints carry the rotary frequencies; they are recomputed from config.json.
    "self_attn.rotary_emb": NOT_LOADED,
    "model.rotary_emb": NOT_LOADED,
}

ARCHITECTURE = Architecture(
    name="llama",
    hf_classes=("LlamaForCausalLM",),
    model_class=LlamaForCausalLM,
    fused=FUSED,
    tp_splits=TP_SPLITS,
    gguf=GGUFFormat(names=("llama",), qk_interleaved=True),  # Mistral GGUFs say "llama" too: converted as Llama
)
