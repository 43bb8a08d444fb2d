"""How long this test process was kept off the CPU: a pause a client sees while its own threads wait on the run
queue is the machine's, not the daemon's.

On this 2-core machine, with other tests' daemons beside it, the kernel's group scheduling can leave a light process
(a test, mostly asleep) runnable but not running for a second or more while heavier groups run: measured beside a
huge prompt's tokenizing, the stream reader waited 0.4-1.5 s of a 0.5-1.5 s pause while the daemon's frontend loop
waited under 0.25 s. Linux's schedstat counts that wait per thread."""

from __future__ import annotations

import os
from pathlib import Path


def _waits() -> dict[str, float]:
    """Seconds each thread of this process has waited on a run queue, by thread id (nothing where the kernel does
    not keep schedstat)."""
    waits = {}
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            waits[task.name] = int((task / "schedstat").read_text().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile, or no schedstat
    return waits


class RunQueueWait:
    """The longest any thread of this process waited on the run queue between start() and seconds()."""

    def __init__(self) -> None:
        self._start: dict[str, float] = {}

    def start(self) -> None:
        self._start = _waits()

    def seconds(self) -> float:
        return max((wait - self._start.get(tid, 0.0) for tid, wait in _waits().items()), default=0.0)
