"""Malformed GGUF files read in process: tests/test_gguf_malformed.py's corpus and random header flips, each read or
refused (ValueError naming the file) within a second and without growing past 100 MB."""

from __future__ import annotations

import tempfile
import time
import tracemalloc
from pathlib import Path

from hypothesis import strategies as st
from test_gguf_malformed import LAYOUT, MUTANTS

from chaos.report import Outcome
from gpu_runtime.gguf.reader import read_gguf

BOUND_S, BOUND_BYTES = 1.0, 100 << 20
_GOOD = LAYOUT.file()


def _flipped(flips: list[tuple[int, int]]) -> bytes:
    content = bytearray(_GOOD)
    for offset, value in flips:
        content[offset % len(LAYOUT.header)] = value
    return bytes(content)


# (kind, bytes): "corpus: <name>" must be refused; "flips" may be read or refused.
gguf_file = st.one_of(
    st.sampled_from(sorted(MUTANTS)).map(lambda name: (f"corpus: {name}", MUTANTS[name])),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4).map(
        lambda flips: ("flips", _flipped(flips))
    ),
)


class GgufReader:
    """Writes each file into a private directory and reads it as a worker would, timing it and tracing its memory."""

    def __init__(self):
        self._directory = tempfile.TemporaryDirectory(prefix="tokend-chaos-gguf-")
        self._path = Path(self._directory.name) / "model.gguf"

    def close(self) -> None:
        self._directory.cleanup()

    def send(self, value: tuple[str, bytes]) -> Outcome:
        kind, content = value
        self._path.write_bytes(content)
        tracemalloc.start()
        started = time.perf_counter()
        try:
            read_gguf(self._path)
            error = None
        except ValueError as refused:
            error = refused
        except Exception as other:  # any other exception is one the reader let escape
            return Outcome(f"crashed: {type(other).__name__}", "bad_answers", f"{kind}: {other!r}"[:300])
        finally:
            elapsed = time.perf_counter() - started
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        if elapsed > BOUND_S or peak > BOUND_BYTES:
            return Outcome("too slow or too big", "hung", f"{kind}: {elapsed:.2f} s, {peak >> 20} MiB")
        if error is None:
            if kind.startswith("corpus"):
                return Outcome("read a malformed file", "not_refused", kind)
            return Outcome("read (a flip that left it well-formed)")
        named = str(self._path) in str(error) and "GGUF" in str(error)
        if kind.startswith("corpus") and not named:
            return Outcome("refused without naming the file", "bad_answers", f"{kind}: {error}"[:300])
        return Outcome("refused, naming the field" if named else "refused")
