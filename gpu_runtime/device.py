"""Turns the configured device and dtype names into torch's, resolving "auto"."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """ "auto" is cuda when present, else cpu; ValueError names the field for anything torch does not know."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(name)
    except RuntimeError as error:
        raise ValueError(f"device: {name!r} is not a torch device ({error})") from None


def checkpoint_dtype(model_dir: str | Path) -> str | None:
    """The dtype a checkpoint's config.json says its weights are in (`dtype` since transformers 5, `torch_dtype`
    before), or None when it does not say."""
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    value = raw.get("dtype") or raw.get("torch_dtype")
    return str(value).removeprefix("torch.") if value else None


def resolve_dtype(
    name: str, device: torch.device, checkpoint: str | None = None, bf16_supported: bool | None = None
) -> torch.dtype:
    """ "auto" on CUDA follows the checkpoint as vLLM does: float16 and bfloat16 as given, float32 (or unsaid) as
    bfloat16 (full precision would halve the KV cache and the speed for no gain in serving), and bfloat16 as
    float16 on a GPU without bfloat16 (before Ampere). Elsewhere "auto" is float32: CPU bfloat16 matmuls are
    slow, and the CPU tests compare float32 outputs.

    `bf16_supported` is asked of torch when unset (a parameter so that the choice is testable without a GPU).
    """
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if checkpoint == "float16":
        return torch.float16
    if bf16_supported is None:
        bf16_supported = torch.cuda.is_bf16_supported()
    return torch.bfloat16 if bf16_supported else torch.float16
