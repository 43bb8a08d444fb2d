"""The embedded default model: a tiny Llama with fixed-seed random weights, written on first use."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

DEFAULT_MODEL_NAME = "tokend-tiny-random"
_VERSION = "v1"  # bump when the recipe below changes, so stale caches are not served
_SEED = 1234
_BOS, _EOS = "<|begin_of_text|>", "<|end_of_text|>"
_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def cache_dir() -> Path:
    """$TOKEND_CACHE_DIR, else $XDG_CACHE_HOME/tokend, else ~/.cache/tokend."""
    if "TOKEND_CACHE_DIR" in os.environ:
        return Path(os.environ["TOKEND_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokend"


def ensure_default_model() -> Path:
    """Returns the default model's directory, writing it first if this machine has none yet."""
    target = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a scratch directory and rename, so a concurrent first use never sees half a model.
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".writing-"))
    try:
        _write_model(scratch)
        os.rename(scratch, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _write_model(directory: Path) -> None:
    tokenizer = byte_level_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    bos_id, eos_id = tokenizer.token_to_id(_BOS), tokenizer.token_to_id(_EOS)
    config = {**_CONFIG, "vocab_size": tokenizer.get_vocab_size(), "bos_token_id": bos_id, "eos_token_id": eos_id}
    _write_json(directory / "config.json", config)
    _write_json(directory / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    _write_json(
        directory / "tokenizer_config.json",
        {"bos_token": _BOS, "eos_token": _EOS, "chat_template": _CHAT_TEMPLATE, "model_max_length": 2048},
    )
    save_file(_random_weights(config), str(directory / "model.safetensors"))


def byte_level_tokenizer() -> Tokenizer:
    """256 byte tokens and no merges, so any text round-trips; plus begin/end-of-text specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([_BOS, _EOS])
    bos_id = tokenizer.token_to_id(_BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{_BOS} $A", special_tokens=[(_BOS, bos_id)])
    return tokenizer


def _random_weights(config: dict) -> dict[str, torch.Tensor]:
    """transformers-named weights drawn from a fixed seed, so every machine serves the same model."""
    generator = torch.Generator().manual_seed(_SEED)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_size = config["num_attention_heads"] * config["head_dim"]
    kv_size = config["num_key_value_heads"] * config["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.05

    weights = {
        "model.embed_tokens.weight": normal(config["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": normal(q_size, hidden),
            f"{prefix}.self_attn.k_proj.weight": normal(kv_size, hidden),
            f"{prefix}.self_attn.v_proj.weight": normal(kv_size, hidden),
            f"{prefix}.self_attn.o_proj.weight": normal(hidden, q_size),
            f"{prefix}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{prefix}.mlp.up_proj.weight": normal(inter, hidden),
            f"{prefix}.mlp.down_proj.weight": normal(hidden, inter),
            f"{prefix}.input_layernorm.weight": torch.ones(hidden),
            f"{prefix}.post_attention_layernorm.weight": torch.ones(hidden),
        }
    return weights


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
