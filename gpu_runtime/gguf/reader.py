"""GGUFFile: a GGUF checkpoint's metadata as plain Python values, and its tensors as the `gguf` package's
ReaderTensor views of the mapped file (nothing is read until a tensor's data is touched).

The metadata and the tensors' places come from layout_check's bounded walk, which decodes them far faster than
gguf's GGUFReader builds its fields; the tensors' views are made as that reader makes them. A big-endian file (rare)
still goes through GGUFReader itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from gpu_runtime.gguf.layout_check import GGUFLayout, MalformedGGUF, read_gguf_layout

# The element types whose data a ReaderTensor views as values; the others (quantized blocks, BF16) as bytes.
_VALUE_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


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
        layout = read_gguf_layout(path)  # bounded: gguf's reader trusts the header's counts and offsets
        if not layout.little_endian:
            reader = GGUFReader(path)
            return GGUFFile(path, {name: f.contents() for name, f in reader.fields.items()}, list(reader.tensors))
        return GGUFFile(path, layout.metadata, _tensors(path, layout))
    except MalformedGGUF as error:
        raise ValueError(f"model: {path} is not a well-formed GGUF file: {error}") from None
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as error:
        raise ValueError(f"model: {path} is not a readable GGUF file: {error!r}") from None


def _tensors(path: Path, layout: GGUFLayout) -> list[ReaderTensor]:
    """Each tensor as GGUFReader makes it: a view of the mapped file, typed for float and int tensors, bytes shaped
    [..., rows, bytes per row] for quantized ones."""
    mapped = np.memmap(path, mode="r")
    tensors = []
    for place in layout.tensors:
        ggml_type = GGMLQuantizationType(place.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(place.dims))
        shape = tuple(reversed(place.dims))
        item_type = _VALUE_TYPES.get(ggml_type)
        if item_type is None:
            item_type, shape = np.uint8, quant_shape_to_byte_shape(shape, ggml_type)
        data = mapped[place.offset : place.offset + place.n_bytes].view(item_type).reshape(shape)
        tensors.append(ReaderTensor(name=place.name, tensor_type=ggml_type, shape=np.array(place.dims, np.uint64),
                                    n_elements=n_elements, n_bytes=n_elements * type_size // block_size,
                                    data_offset=place.offset, data=data, field=None))  # fmt: skip
    return tensors


def engine_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """GGUF lists a tensor's dimensions fastest-varying first (ggml's ne[]); torch and transformers, slowest first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))
