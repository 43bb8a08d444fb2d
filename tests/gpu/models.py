"""The GPU check's models and runs: checkpoints written as the tests write theirs (tests/checkpoints.py:
transformers' own save_pretrained of a small random Llama or Qwen2), a 1.5B-shaped bfloat16 one, engines on them,
and transformers' greedy reference on the same device."""

from __future__ import annotations

import gc
import json
import os
import random
import tempfile
from pathlib import Path

import torch

from gpu.run import WORK_DIR_VARIABLE

_own_work_dir: list[tempfile.TemporaryDirectory] = []


def work_dir() -> Path:
    """Where checkpoints go: the directory gpu/run.py made for the run, which it removes at its end (even
    when a section's process is killed), else one of this process's own, removed when it exits."""
    if os.environ.get(WORK_DIR_VARIABLE):
        return Path(os.environ[WORK_DIR_VARIABLE])
    if not _own_work_dir:
        _own_work_dir.append(tempfile.TemporaryDirectory(prefix="tokend-gpu-check-"))
    return Path(_own_work_dir[0].name)


def checkpoint(kind: str, **overrides) -> Path:
    from checkpoints import LLAMA_GQA, QWEN2, write_checkpoint

    spec = {"llama": LLAMA_GQA, "qwen2": QWEN2}[kind]
    return write_checkpoint(Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=work_dir())), spec, **overrides)


def prompts(count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def llm(model_dir: Path, device: str, **options):
    from gpu_runtime import LLM

    options.setdefault("kv_cache_bytes", 64 << 20)
    return LLM(str(model_dir), device=device, **options)


def generate(llm, prompts: list[list[int]], params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def greedy(num_tokens: int, logprobs: int | None = None):
    from gpu_runtime import SamplingParams

    return SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)


def release() -> None:
    """Returns what the engines just deleted held on the device to it, before the next measurement."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def transformers(model_dir: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # exactly max_new_tokens, as ignore_eos
    return model


@torch.inference_mode()
def transformers_greedy(model, prompts: list[list[int]], num_tokens: int, device: str) -> list[list[int]]:
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False)
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


# A Qwen2-1.5B-sized Llama (1.54 B parameters, tied embeddings: 3.1 GB in bfloat16), and a tiny one for the dry run.
LOADER_SHAPES = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
}  # fmt: skip


def write_bf16_checkpoint(directory: Path, shape: dict) -> tuple[Path, int]:
    """A bfloat16 Llama checkpoint of `shape` with random weights, written tensor by tensor as safetensors; returns
    its directory and its weights' bytes."""
    from safetensors.torch import save_file

    from gpu_runtime.default_model import byte_level_tokenizer

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 256,
              "eos_token_id": 257, **shape}  # fmt: skip
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * hidden // shape["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {f"{prefix}{norm}_layernorm.weight": (hidden,) for norm in ("input", "post_attention")}
        shapes |= {f"{prefix}self_attn.{name}_proj.weight": (rows, hidden) for name, rows in
                   (("q", hidden), ("k", kv), ("v", kv), ("o", hidden))}  # fmt: skip
        shapes |= {f"{prefix}mlp.{name}_proj.weight": (inter, hidden) for name in ("gate", "up")}
        shapes[f"{prefix}mlp.down_proj.weight"] = (hidden, inter)
    generator = torch.Generator().manual_seed(0)
    weights = {
        name: torch.ones(size, dtype=torch.bfloat16)
        if name.endswith("norm.weight")
        else (torch.randn(size, generator=generator) * 0.02).to(torch.bfloat16)
        for name, size in shapes.items()
    }
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    return directory, sum(t.numel() * t.element_size() for t in weights.values())
