"""Random-weight checkpoints written by transformers itself, the reference the engine must match."""

from __future__ import annotations

from pathlib import Path

import torch

from gpu_runtime.default_model import byte_level_tokenizer

VOCAB_SIZE = 258  # the byte-level tokenizer's 256 bytes plus begin/end of text

LLAMA_GQA = {
    "kind": "llama",
    "num_attention_heads": 8,
    "num_key_value_heads": 2,  # grouped-query attention, 4 query heads per KV head
    "rope_theta": 50000.0,  # not the default 10000
}
LLAMA3_ROPE = {
    "kind": "llama",
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "tie_word_embeddings": True,
}
QWEN2 = {"kind": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2}
# The newer families, each with every feature it has on (docs/models.md): several layers of each kind, GQA.
QWEN3 = {
    "kind": "qwen3",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # not hidden_size / heads (16): Qwen3's head_dim is its own
    "num_hidden_layers": 3,
}
QWEN3_TIED = {**QWEN3, "tie_word_embeddings": True}  # the small Qwen3 tie them; 8B and up do not
MIXTRAL = {
    "kind": "mixtral",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "intermediate_size": 96,
    "num_local_experts": 6,
    "num_experts_per_tok": 2,
}
QWEN3_MOE = {
    "kind": "qwen3_moe",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 4,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "moe_intermediate_size": 48,
    "norm_topk_prob": False,
    # Sparse layers 1 and 3 (every second), but 3 is dense too: layers 0, 2 and 3 run intermediate_size's MLP.
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
}
QWEN3_MOE_NORMED = {**QWEN3_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [0]}
GEMMA_WINDOW = 16  # shorter than most prompts and than the tests' shared prefix
GEMMA2 = {
    "kind": "gemma2",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 4,  # sliding, global, sliding, global
    "sliding_window": GEMMA_WINDOW,
    "query_pre_attn_scalar": 24,  # the query scale 24 ** -0.5, not head_dim's
    "attn_logit_softcapping": 4.0,  # low enough to bend the random model's scores
    "final_logit_softcapping": 8.0,
    "tie_word_embeddings": True,  # every Gemma ties them
}
GEMMA3 = {
    "kind": "gemma3",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 6,
    "sliding_window_pattern": 3,  # sliding, sliding, global, sliding, sliding, global
    "sliding_window": GEMMA_WINDOW,
    "query_pre_attn_scalar": 24,
    # The global layers' linear scaling (the 4B and up have factor 8), the sliding layers' own theta.
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "final_logit_softcapping": 8.0,
    "tie_word_embeddings": True,
}
MISTRAL = {  # Mistral 7B v0.1's shape: every layer windowed (its 4096 of 32768), untied
    "kind": "mistral",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "sliding_window": GEMMA_WINDOW,
}
PHI3 = {  # Phi-3-mini-4k's shape: every layer windowed (its 2047 of 4096), untied, the default rotary
    "kind": "phi3",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "sliding_window": GEMMA_WINDOW,
}
PHI3_LONGROPE = {  # Phi-4-mini's: longrope, 3/4 of each head rotated, tied embeddings, no window
    "kind": "phi3",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 3,
    "max_position_embeddings": 4096,
    "original_max_position_embeddings": 1024,  # the prompts stay within it: the short factors (as transformers)
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,  # 12 of 16 dimensions: 6 pairs
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    },
    "tie_word_embeddings": True,
}

_CLASSES = {  # kind: (config class, model class), by name in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}


def write_checkpoint(directory: Path, spec: dict, seed: int = 0, **overrides) -> Path:
    """Saves a small random model with `save_pretrained`, plus a tokenizer, into `directory`."""
    import transformers

    spec = {**spec, **overrides}
    kind = spec.pop("kind")
    config_class, model_class = (getattr(transformers, name) for name in _CLASSES[kind])
    config = config_class(
        vocab_size=spec.pop("vocab_size", VOCAB_SIZE),
        hidden_size=spec.pop("hidden_size", 64),
        intermediate_size=spec.pop("intermediate_size", 160),
        num_hidden_layers=spec.pop("num_hidden_layers", 2),
        max_position_embeddings=spec.pop("max_position_embeddings", 1024),
        # A wide init gives peaked logits, so greedy argmax is not decided by float rounding.
        initializer_range=spec.pop("initializer_range", 0.2),
        bos_token_id=spec.pop("bos_token_id", 256),
        eos_token_id=spec.pop("eos_token_id", 257),
        pad_token_id=spec.pop("pad_token_id", None),
        **spec,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    if kind not in ("llama", "qwen2"):
        _perturb_norms(model)
    model.save_pretrained(directory)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def _perturb_norms(model) -> None:
    """Every norm's weight moved off its initial value (ones; Gemma's zeros, which (1 + w) makes the identity): a
    norm loaded into the wrong place, or scaled by w instead of 1 + w, then shows in the outputs."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.2)


def write_sentence_transformer(directory: Path, spec: dict, pooling_mode: str) -> Path:
    """A random checkpoint saved by sentence-transformers itself (its Pooling `pooling_mode`, then Normalize) into
    `directory`/st: the base model's tensors (no lm_head, no "model." prefix) and a config.json naming the base
    class ("Qwen3Model"), as embedding models ship."""
    from sentence_transformers import SentenceTransformer, models

    source = write_checkpoint(directory / "source", spec)
    transformer = models.Transformer(str(source))
    pooling = models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling_mode)
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu").save(str(directory / "st"))
    return directory / "st"
