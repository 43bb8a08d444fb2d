"""A model's generation: which weights a worker serves, as a short stable id.

The resolved path plus a hash of what identifies the weights without reading them whole: config.json, the
safetensors index (or each safetensors file's header, which names every tensor with its shape and offsets, and
its size and modification time), or a GGUF file's size and modification time. Two workers on the same files
report the same generation; new weights at the same path (a checkpoint overwritten in place) get a new one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_HEADER_LENGTH_BYTES = 8  # safetensors: a little-endian u64, then that many bytes of JSON header


def model_generation(model_dir: Path) -> str:
    """`<directory name>@<12 hex digits>`: readable in logs and ledgers, and unique for the weights."""
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256(str(model_dir).encode())
    files = [model_dir] if model_dir.is_file() else sorted(model_dir.iterdir())
    for path in files:
        if path.name in ("config.json", "model.safetensors.index.json"):
            digest.update(path.name.encode() + path.read_bytes())
        elif path.suffix in (".safetensors", ".gguf"):
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            if path.suffix == ".safetensors":
                digest.update(_safetensors_header(path))
    return f"{model_dir.name}@{digest.hexdigest()[:12]}"


def _safetensors_header(path: Path) -> bytes:
    with path.open("rb") as file:
        length = int.from_bytes(file.read(_HEADER_LENGTH_BYTES), "little")
        return file.read(min(length, 100_000_000))
