"""LoadProgress: how far a checkpoint's weights have loaded, in bytes. On a terminal a tqdm bar on stderr; otherwise
(the daemon's JSON-lines log) a `loading_weights` line every LOG_EVERY_S seconds of a long load, and one
`weights_loaded` line at the end. A process that configured no logging (the offline API, piped) hears nothing."""

from __future__ import annotations

import struct
import sys
import time
from pathlib import Path
from typing import TextIO

import structlog
from tqdm import tqdm

LOG_EVERY_S = 10.0  # a slow disk or a 100 GB checkpoint gets a line this often, a quick load none
BAR_DELAY_S = 1.0  # a load quicker than this never draws a bar


def weight_bytes(path: Path) -> int:
    """The tensor bytes of a .safetensors file: all of it but its 8-byte header length and JSON header."""
    with path.open("rb") as file:
        (header_bytes,) = struct.unpack("<Q", file.read(8))
    return path.stat().st_size - 8 - header_bytes


class LoadProgress:
    def __init__(self, model_dir: Path, files: list[Path], stream: TextIO | None = None):
        self.model = model_dir.name
        self.files = len(files)
        self.total = sum(weight_bytes(path) for path in files)
        self.done = 0
        self.started = self.last_logged = time.monotonic()
        stream = stream or sys.stderr
        self.bar = None
        if stream.isatty():
            self.bar = tqdm(
                total=self.total, desc=f"loading {self.model}", unit="B", unit_scale=True, unit_divisor=1024,
                file=stream, leave=False, delay=BAR_DELAY_S, dynamic_ncols=True,
            )  # fmt: skip
        # Structured lines only where the process set logging up: structlog's default would print to stdout.
        self.log = structlog.get_logger().bind(model=self.model) if structlog.is_configured() else None

    def advance(self, num_bytes: int) -> None:
        self.done += num_bytes
        if self.bar is not None:
            self.bar.update(num_bytes)
            return
        now = time.monotonic()
        if self.log is not None and now - self.last_logged >= LOG_EVERY_S:
            self.last_logged = now
            percent = round(100 * self.done / self.total, 1) if self.total else 100.0
            self.log.info("loading_weights", bytes=self.done, total_bytes=self.total, percent=percent)

    def close(self, completed: bool = True) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.log is not None and completed:
            seconds = time.monotonic() - self.started
            self.log.info("weights_loaded", files=self.files, bytes=self.done, seconds=round(seconds, 3))

    def __enter__(self) -> LoadProgress:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(completed=exc_type is None)
