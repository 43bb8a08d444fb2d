"""read_gguf_layout: walks a GGUF file's header with every count, length and offset bounded by the file's size,
and returns its metadata and its tensors' places.

The `gguf` package's reader trusts the header: a 69-byte file claiming 2^63 metadata entries makes it spin and grow
without end, and a bad offset or type escapes as IndexError or KeyError. This walk reads the same structure with
no allocation proportional to a claimed count (it only steps over bytes that exist), so a malformed file is refused
in time linear in its real size, with an error naming the field. It also decodes the metadata as it goes, about
50x faster than that reader builds it (a 152k-token vocabulary: its tokens and merges in about a second, not a
minute), so gguf/reader.py uses this walk's values and places instead.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType

SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads (version 1 files predate 64-bit counts)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 8  # arrays of arrays are legal; nothing real nests deeper than two
# Fixed-size value types: their struct codes. STRING and ARRAY are variable-sized and handled apart.
_FIXED = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip
_MIN_ITEM_BYTES = {**{t: struct.calcsize("<" + c) for t, c in _FIXED.items()}, GGUFValueType.STRING: 8,
                   GGUFValueType.ARRAY: 12}  # fmt: skip


class MalformedGGUF(ValueError):
    """The file is not a well-formed GGUF file; the message names the field and the offset."""


@dataclass(frozen=True, slots=True)
class TensorPlace:
    name: str
    dims: tuple[int, ...]  # ggml's ne[]: the fastest-varying dimension first
    ggml_type: int
    offset: int  # of its data, from the start of the file
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFLayout:
    metadata: dict[str, Any]  # each value as gguf's ReaderField.contents() gives it: int, float, bool, str, lists
    tensors: list[TensorPlace]
    little_endian: bool


class _Cursor:
    """Reads little- or big-endian values out of the file's bytes, never past their end."""

    def __init__(self, data: bytes, byte_order: str):
        self.data, self.order, self.offset = data, byte_order, 0

    @property
    def remaining(self) -> int:
        return len(self.data) - self.offset

    def take(self, code: str, field: str):
        size = struct.calcsize(self.order + code)
        if size > self.remaining:
            raise MalformedGGUF(f"{field}: the file ends at byte {len(self.data)}, inside this field")
        (value,) = struct.unpack_from(self.order + code, self.data, self.offset)
        self.offset += size
        return value

    def skip(self, count: int, field: str) -> None:
        if count < 0 or count > self.remaining:
            raise MalformedGGUF(f"{field}: claims {count} bytes at offset {self.offset}, but {self.remaining} remain")
        self.offset += count

    def string(self, field: str) -> bytes:
        length = self.take("Q", f"{field} length")
        start = self.offset
        self.skip(length, field)
        return self.data[start : self.offset]

    def text(self, field: str) -> str:
        try:
            return self.string(field).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedGGUF(f"{field}: not UTF-8 text") from None

    def array(self, code: str, count: int) -> list:
        """`count` fixed-size values at once (bounds already checked by the caller)."""
        dtype = np.dtype(self.order + code)
        values = np.frombuffer(self.data, dtype, count, self.offset).tolist()
        self.offset += count * dtype.itemsize
        return values


def _value(cursor: _Cursor, value_type: int, field: str, depth: int = 0) -> Any:
    """Reads one value, as gguf's ReaderField.contents() would give it."""
    if value_type in _FIXED:
        return cursor.take(_FIXED[value_type], field)
    if value_type == GGUFValueType.STRING:
        return cursor.text(field)
    if value_type != GGUFValueType.ARRAY:
        raise MalformedGGUF(f"{field}: unknown value type {value_type}")
    if depth >= MAX_ARRAY_DEPTH:
        raise MalformedGGUF(f"{field}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
    item_type = cursor.take("I", f"{field} item type")
    count = cursor.take("Q", f"{field} count")
    if item_type not in _MIN_ITEM_BYTES:
        raise MalformedGGUF(f"{field}: unknown array item type {item_type}")
    if count * _MIN_ITEM_BYTES[item_type] > cursor.remaining:
        raise MalformedGGUF(f"{field}: claims {count} items, more than the {cursor.remaining} bytes left hold")
    if item_type in _FIXED:
        return cursor.array(_FIXED[item_type], count)
    if item_type == GGUFValueType.STRING:
        return [cursor.text(f"{field}[{index}]") for index in range(count)]
    return [_value(cursor, item_type, f"{field}[{index}]", depth + 1) for index in range(count)]


def _header(cursor: _Cursor) -> tuple[int, int]:
    version = cursor.take("I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise MalformedGGUF(f"version: {version} is not one of {SUPPORTED_VERSIONS}")
    tensor_count = cursor.take("Q", "tensor_count")
    kv_count = cursor.take("Q", "metadata_kv_count")
    # Each metadata entry takes at least 12 bytes (key length, value type), each tensor info at least 24.
    if kv_count * 12 + tensor_count * 24 > cursor.remaining:
        raise MalformedGGUF(f"metadata_kv_count/tensor_count: {kv_count} entries and {tensor_count} tensors cannot "
                            f"fit in the {cursor.remaining} bytes left")  # fmt: skip
    return tensor_count, kv_count


def _tensor_info(cursor: _Cursor, index: int) -> TensorPlace:
    """The index-th tensor's name, dims, type, data offset (from the data section's start) and data bytes."""
    name = cursor.text(f"tensor[{index}].name")
    field = f"tensor {name!r}"
    n_dims = cursor.take("I", f"{field} n_dims")
    if not 1 <= n_dims <= MAX_DIMS:
        raise MalformedGGUF(f"{field}: n_dims {n_dims} is not within 1..{MAX_DIMS}")
    dims = tuple(cursor.take("Q", f"{field} dims[{axis}]") for axis in range(n_dims))
    elements = 1
    for size in dims:
        elements *= size
    ggml_type = cursor.take("I", f"{field} type")
    try:
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    except (KeyError, ValueError):
        raise MalformedGGUF(f"{field}: unknown ggml type {ggml_type}") from None
    if elements % block_size:
        raise MalformedGGUF(f"{field}: {elements} elements are not whole blocks of {block_size}")
    return TensorPlace(name, dims, ggml_type, cursor.take("Q", f"{field} offset"), elements // block_size * type_size)


def read_gguf_layout(path: str | Path) -> GGUFLayout:
    """The file's metadata and tensor places; MalformedGGUF naming the first field that is out of bounds."""
    with Path(path).open("rb") as file:
        if os.fstat(file.fileno()).st_size < 8:
            raise MalformedGGUF("magic: the file is shorter than a GGUF header")
        # A read-only map: the walk touches only the header's pages, however big the tensors behind it are.
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _walk(data)


def check_gguf_layout(path: str | Path) -> None:
    """Raises MalformedGGUF naming the first field that is out of bounds; returns for a well-formed file."""
    read_gguf_layout(path)


def _walk(data) -> GGUFLayout:
    file_size = len(data)
    if struct.unpack_from("<I", data)[0] != GGUF_MAGIC:
        raise MalformedGGUF("magic: the file does not start with 'GGUF'")
    version = struct.unpack_from("<I", data, 4)[0]
    cursor = _Cursor(data, "<" if version & 0xFFFF else ">")  # gguf.GGUFReader's own byte-order test
    cursor.offset = 4
    tensor_count, kv_count = _header(cursor)
    alignment = GGUF_DEFAULT_ALIGNMENT
    # The header's own fields first, under the names gguf's reader gives them.
    version = struct.unpack_from(cursor.order + "I", data, 4)[0]
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count}
    for index in range(kv_count):
        key = cursor.text(f"metadata[{index}].key")
        value = metadata[key] = _value(cursor, cursor.take("I", f"metadata {key!r} type"), f"metadata {key!r}")
        if key == "general.alignment":
            if not isinstance(value, int) or value <= 0 or value & (value - 1):
                raise MalformedGGUF(f"metadata 'general.alignment': {value!r} is not a power of two")
            alignment = value
    tensors = [_tensor_info(cursor, index) for index in range(tensor_count)]
    if len({t.name for t in tensors}) != len(tensors):
        raise MalformedGGUF("tensors: a name appears twice")
    data_start = -(-cursor.offset // alignment) * alignment
    for tensor in tensors:
        if tensor.offset % alignment or data_start + tensor.offset + tensor.n_bytes > file_size:
            raise MalformedGGUF(
                f"tensor {tensor.name!r}: its data ({tensor.n_bytes} bytes at offset {tensor.offset}) is outside the "
                f"file's {file_size - data_start} data bytes or off its {alignment}-byte alignment"
            )
    placed = [TensorPlace(t.name, t.dims, t.ggml_type, data_start + t.offset, t.n_bytes) for t in tensors]
    return GGUFLayout(metadata, placed, cursor.order == "<")
