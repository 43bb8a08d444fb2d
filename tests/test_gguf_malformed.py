"""Malformed GGUF files (truncated, huge counts, bad offsets, bad types, random flips): each is refused by name,
within a second and without the memory growth the `gguf` package's reader shows on them, before any worker loads it."""

from __future__ import annotations

import contextlib
import random
import struct
import time
import tracemalloc

import numpy as np
import pytest
from gguf import GGUFReader

from gpu_runtime.gguf.reader import read_gguf

F32, STRING, ARRAY, UINT32 = 6, 8, 9, 4  # GGUF value types
GGML_F32 = 0
ALIGN = 32


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


class _Layout:
    """A small well-formed GGUF file, built by hand so that each field's offset is known."""

    def __init__(self):
        self.header = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 2, 3))
        self.offsets: dict[str, int] = {"version": 4, "tensor_count": 8, "kv_count": 16}
        self._kv("general.architecture", STRING, _string("llama"))
        self.offsets["array_count"] = len(self.header) + 8 + len("tokenizer.ggml.tokens") + 4 + 4
        tokens = [_string(t) for t in ("<s>", "a", "b")]
        self._kv("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 3) + b"".join(tokens))
        self._kv("llama.block_count", UINT32, struct.pack("<I", 1))
        self.offsets["first_key_length"] = 24
        self.offsets["value_type"] = 24 + 8 + len("general.architecture")
        self._tensor("token_embd.weight", (4, 3), 0)
        self._tensor("output_norm.weight", (4,), 64)
        padding = -len(self.header) % ALIGN
        # token_embd's 48 bytes, padding to the next 32-byte boundary, output_norm's 16 bytes: nothing after them.
        self.data = (
            bytes(padding) + np.arange(12, dtype=np.float32).tobytes() + bytes(16) + np.ones(4, np.float32).tobytes()
        )

    def _kv(self, key: str, value_type: int, payload: bytes) -> None:
        self.header += _string(key) + struct.pack("<I", value_type) + payload

    def _tensor(self, name: str, dims: tuple[int, ...], offset: int) -> None:
        self.offsets[f"{name}.n_dims"] = len(self.header) + 8 + len(name)
        self.header += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        self.offsets[f"{name}.type"] = len(self.header)
        self.header += struct.pack("<I", GGML_F32)
        self.offsets[f"{name}.offset"] = len(self.header)
        self.header += struct.pack("<Q", offset)

    def file(self) -> bytes:
        return bytes(self.header) + self.data

    def with_field(self, field: str, code: str, value: int) -> bytes:
        content = bytearray(self.file())
        struct.pack_into("<" + code, content, self.offsets[field], value)
        return bytes(content)


LAYOUT = _Layout()
MUTANTS = {
    "bad magic": b"GGUX" + LAYOUT.file()[4:],
    "version 99": LAYOUT.with_field("version", "I", 99),
    "kv_count 2^63": LAYOUT.with_field("kv_count", "Q", 1 << 63),
    "tensor_count 2^40": LAYOUT.with_field("tensor_count", "Q", 1 << 40),
    "key length 2^62": LAYOUT.with_field("first_key_length", "Q", 1 << 62),
    "value type 13": LAYOUT.with_field("value_type", "I", 13),
    "array count 2^60": LAYOUT.with_field("array_count", "Q", 1 << 60),
    "n_dims 0": LAYOUT.with_field("token_embd.weight.n_dims", "I", 0),
    "n_dims 2^31": LAYOUT.with_field("token_embd.weight.n_dims", "I", 1 << 31),
    "ggml type 9999": LAYOUT.with_field("output_norm.weight.type", "I", 9999),
    "offset past the end": LAYOUT.with_field("output_norm.weight.offset", "Q", 1 << 40),
    "offset off alignment": LAYOUT.with_field("output_norm.weight.offset", "Q", 65),
    # 69 bytes that make gguf's own reader spin and grow without end: one UINT16 array claiming 2^63 items.
    "69-byte spin": (
        b"GGUF"
        + struct.pack("<IQQ", 3, 1, 1)
        + _string("k")
        + struct.pack("<IIQ", ARRAY, 2, 1 << 63)
        + bytes(range(24))
    )[:69],
}
MUTANTS.update({f"truncated at {n}": LAYOUT.file()[:n] for n in (0, 3, 7, 15, 23, 40, 90, len(LAYOUT.header) - 3)})
MUTANTS[f"data truncated at {len(LAYOUT.file()) - 8}"] = LAYOUT.file()[:-8]


def _refused_quickly_and_small(path) -> str:
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(ValueError) as refused:
            read_gguf(path)
        elapsed = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert elapsed < 1.0, f"took {elapsed:.2f} s"
    assert peak < 100 << 20, f"allocated {peak >> 20} MiB"
    return str(refused.value)


def test_the_hand_built_file_is_well_formed_for_ggufs_own_reader_and_ours(tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(LAYOUT.file())
    theirs = GGUFReader(path)
    ours = read_gguf(path)
    assert ours.tensor_names() == {t.name for t in theirs.tensors} == {"token_embd.weight", "output_norm.weight"}
    assert ours.architecture == "llama"
    assert ours.tensors[0].data.tolist()[0][:4] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_malformed_file_is_refused_naming_the_field(name, tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(MUTANTS[name])
    message = _refused_quickly_and_small(path)
    assert str(path) in message and "GGUF" in message


def test_random_header_flips_are_read_or_refused_never_crash(tmp_path):
    """Seeded byte flips over the header: whatever they make is either read or refused with ValueError."""
    rng = random.Random(7)
    good = LAYOUT.file()
    for trial in range(300):
        content = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            content[rng.randrange(len(LAYOUT.header))] = rng.randrange(256)
        path = tmp_path / f"flip{trial}.gguf"
        path.write_bytes(bytes(content))
        started = time.perf_counter()
        with contextlib.suppress(ValueError):
            read_gguf(path)
        assert time.perf_counter() - started < 1.0, f"trial {trial}"
