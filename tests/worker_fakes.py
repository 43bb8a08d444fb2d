"""Fakes for the daemon's side of the worker set: a clock, a log and child processes that start, warm up, exit and
take signals when the test says, so that WorkerPool and Supervisor run in process with no process and no model."""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass, field
from pathlib import Path

from daemon.children import Child

_PIDS = itertools.count(1000)


class FakeClock:
    """time.monotonic as the test moves it."""

    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class FakeLog:
    """The daemon's structured log, kept: (level, event, fields). Tests assert on the pool's API, not on these."""

    def __init__(self):
        self.entries: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.entries.append((level, event, fields))


class FakeProcess:
    """A running process: it exits when the test (or a SIGTERM, if it heeds one) says so."""

    def __init__(self, exits_on_sigterm: bool):
        self.pid = next(_PIDS)
        self.returncode: int | None = None
        self.signals: list[int] = []
        self.heeds_sigterm = exits_on_sigterm

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)
        if signum == signal.SIGTERM and self.heeds_sigterm:
            self.returncode = 0

    def kill(self) -> None:
        self.returncode = -signal.SIGKILL

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@dataclass(eq=False)
class FakeChild(Child):
    """A Child whose process is a FakeProcess: the back-off and the give-up rules are Child's own."""

    warm: bool = False  # its loop is running (a scheduler's heartbeat; a frontend's bound listeners)
    starts: int = 0
    exits_on_sigterm: bool = True
    processes: list[FakeProcess] = field(default_factory=list)

    def start(self, now: float | None = None) -> None:
        self.process = FakeProcess(self.exits_on_sigterm)
        self.processes.append(self.process)
        self.started_at = 0.0 if now is None else now
        self.restart_at = None
        self.warm = False
        self.starts += 1

    def warm_up(self) -> None:
        self.warm = True

    def exit(self, code: int) -> None:
        assert self.process is not None and self.process.returncode is None, f"{self.name} is not running"
        self.process.returncode = code

    @property
    def is_running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    @property
    def is_listening(self) -> bool:
        return self.warm

    def heartbeat_age(self, now_wall: float) -> float | None:
        return 0.0 if self.warm else None

    def stop(self, timeout: float) -> None:
        if self.is_running:
            self.process.returncode = 0


class FakeChildren:
    """The factory WorkerPool and Supervisor take in place of Child: every child it made, by name."""

    def __init__(self):
        self.by_name: dict[str, FakeChild] = {}

    def __call__(self, name: str, module: str, spec_json: str, heartbeat_path: Path | None = None,
                 listening_path: Path | None = None, env: dict[str, str] | None = None) -> FakeChild:  # fmt: skip
        child = FakeChild(name, module, spec_json, heartbeat_path, listening_path, env=env or {})
        self.by_name[name] = child
        return child

    def scheduler(self, worker_id: str) -> FakeChild:
        return self.by_name[f"scheduler {worker_id}"]
