"""The daemon's child processes by kind (their `tokend: ...` titles), their ages, and signals sent to them."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path

from harness.local_daemon import LocalDaemon

TITLES = {"scheduler": "tokend: scheduler", "frontend": "tokend: frontend", "gateway": "tokend: gateway"}
# The supervisor gives up after 8 crashes of a child that each came within 30 s of its start. After a few such
# kills in a row, the next waits until the process has run this long: the run tests recovery, never that give-up.
MIN_AGE_BEFORE_KILL_S = 31.0
MAX_YOUNG_KILLS_IN_A_ROW = 3
_young_kills: Counter = Counter()  # kind -> kills in a row of a process younger than MIN_AGE_BEFORE_KILL_S


def pid_of(daemon: LocalDaemon, kind: str, timeout: float = 60.0) -> int | None:
    """The pid of the (first) live process of this kind, waiting for a restarting one to come up."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for pid in daemon.child_pids(TITLES[kind]) if _state(pid) not in ("Z", "X", None)]
        if pids:
            return min(pids)
        if time.monotonic() > deadline or daemon.process.poll() is not None:
            return None
        time.sleep(0.1)


def age_s(pid: int) -> float:
    """Seconds since the process started (0 if it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    start_ticks = int(stat[stat.rfind(")") + 2 :].split()[19])  # field 22, starttime
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def kill(kind: str, pid: int, deadline: float) -> tuple[bool, float]:
    """SIGKILL, after waiting (up to the deadline, time.monotonic()) if the supervisor's give-up is near.
    Returns whether the process was there to kill, and the seconds waited."""
    waited = 0.0
    if _young_kills[kind] >= MAX_YOUNG_KILLS_IN_A_ROW:
        waited = max(0.0, min(MIN_AGE_BEFORE_KILL_S - age_s(pid), deadline - time.monotonic()))
        time.sleep(waited)
    _young_kills[kind] = _young_kills[kind] + 1 if age_s(pid) < MIN_AGE_BEFORE_KILL_S else 0
    return send(pid, signal.SIGKILL), waited


def send(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def continue_all(daemon: LocalDaemon) -> None:
    """SIGCONT to every process of the daemon: nothing may stay stopped, whatever happened to the run."""
    for pid in daemon.session_pids():
        send(pid, signal.SIGCONT)


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2]
