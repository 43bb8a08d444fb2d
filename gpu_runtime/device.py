"""Turns the configured device and dtype names into torch's, resolving "auto"."""

from __future__ import annotations

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


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]
