"""GGUFFile: a GGUF checkpoint's metadata as plain Python values, and its tensors, read with the `gguf` package
(the llama.cpp project's own reader; it maps the file, so nothing is read until a tensor's data is touched)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, ReaderTensor

from gpu_runtime.gguf.layout_check import MalformedGGUF, check_gguf_layout


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: list[ReaderTensor]

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "")

    def hparam(self, key: str, default: Any = None) -> Any:
        """An architecture-scoped value: hparam("block_count") reads `llama.block_count` in a Llama file."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}


def read_gguf(path: str | Path) -> GGUFFile:
    """Opens a GGUF file; raises ValueError naming it (and the field at fault) when it is not a well-formed one."""
    path = Path(path)
    try:
        check_gguf_layout(path)  # bounded first: gguf's reader trusts the header's counts and offsets
        reader = GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except MalformedGGUF as error:
        raise ValueError(f"model: {path} is not a well-formed GGUF file: {error}") from None
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"model: {path} is not a readable GGUF file: {error!r}") from None
    return GGUFFile(path, metadata, list(reader.tensors))


def engine_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists a tensor's dimensions fastest-varying first (ggml's ne[]); torch and transformers, slowest first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))
