"""Progress on stderr: a tqdm bar when tqdm is installed, else a plain line every few seconds."""

from __future__ import annotations

import sys
import time

try:
    from tqdm import tqdm
except ImportError:  # pragma: no cover - tqdm is a dependency of tokend, but the run must not need it
    tqdm = None


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.total = total
        self.done = 0
        self.phase = ""
        self._bar = tqdm(total=total, file=sys.stderr, mininterval=1.0, unit="step") if tqdm and enabled else None
        self._enabled = enabled
        self._last_line = 0.0

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        if self._bar is not None:
            self._bar.set_description(phase, refresh=True)
        elif self._enabled:
            print(f"chaos: {phase}", file=sys.stderr, flush=True)

    def step(self, count: int = 1) -> None:
        self.done += count
        if self._bar is not None:
            self._bar.update(count)
        elif self._enabled and time.monotonic() - self._last_line > 5:
            self._last_line = time.monotonic()
            print(f"chaos: {self.phase} {self.done}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
