"""Fault injection under load: kill -9 and SIGSTOP/SIGCONT each process kind in rotation, then time the recovery."""

from __future__ import annotations

import datetime
import random
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from harness.local_daemon import LocalDaemon

from chaos import processes
from chaos.canary import Canary
from chaos.report import Report

# Each kind of process is killed every sixth fault, so that it has usually run a while by then.
ROTATION = (
    ("kill", "scheduler"),
    ("stop", "frontend"),
    ("kill", "gateway"),
    ("stop", "scheduler"),
    ("kill", "frontend"),
    ("stop", "gateway"),
)
STOP_SECONDS = (1.0, 3.0)  # far below the stall timeout (120 s), after which a stopped scheduler is killed
SETTLE_S = 1.0  # load runs this long before each fault, so that streams are in flight when it lands


@dataclass(slots=True)
class Fault:
    kind: str  # "kill" (SIGKILL) or "stop" (SIGSTOP, then SIGCONT)
    process: str  # scheduler | frontend | gateway
    pid: int | None
    at: float  # time.time() of the signal
    stopped_for_s: float | None = None
    waited_before_s: float = 0.0  # for a kill: until the process was old enough (see processes)
    recovered_in_s: float | None = None
    detail: str = ""


def inject_faults(
    daemon: LocalDaemon,
    canary: Canary,
    report: Report,
    count: int,
    seed: int,
    deadline: float,
    recovery_bound_s: float,
    on_fault: Callable[[], None],
) -> list[Fault]:
    """Injects `count` faults (fewer if the deadline, time.monotonic(), comes first); records each in the report."""
    rng = random.Random(seed)
    faults = []
    for index in range(count):
        if time.monotonic() > deadline or daemon.process.poll() is not None:
            report.skip("faults", count - index)
            break
        kind, process = ROTATION[index % len(ROTATION)]
        time.sleep(SETTLE_S)
        fault, signalled = _inject(daemon, kind, process, rng, deadline)
        if fault.pid is not None:
            recovered = canary.wait_recovered(signalled, recovery_bound_s)
            fault.recovered_in_s = None if recovered is None else round(recovered, 2)
        faults.append(fault)
        report.faults_injected.append({**asdict(fault), "at": _utc(fault.at)})
        on_fault()
        if fault.recovered_in_s is None:
            why = fault.detail or f"not serving {recovery_bound_s:.0f} s after the fault"
            report.lose("not_recovered", "faults", f"{kind} {process}", why)
    return faults


def _utc(unix_s: float) -> str:
    return (
        datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def _inject(daemon: LocalDaemon, kind: str, process: str, rng: random.Random, deadline: float) -> tuple[Fault, float]:
    """The fault, and when (time.monotonic()) its signal went."""
    pid = processes.pid_of(daemon, process)
    if pid is None:
        return Fault(kind, process, None, time.time(), detail=f"no live {process} process to signal"), time.monotonic()
    if kind == "kill":
        killed, waited = processes.kill(process, pid, deadline)
        fault, signalled = Fault(kind, process, pid, time.time(), waited_before_s=round(waited, 1)), time.monotonic()
        if not killed:
            fault.detail = "the process was already gone"
        return fault, signalled
    stopped_for = rng.uniform(*STOP_SECONDS)
    fault, signalled = Fault(kind, process, pid, time.time(), stopped_for_s=round(stopped_for, 2)), time.monotonic()
    try:
        processes.send(pid, signal.SIGSTOP)
        time.sleep(stopped_for)
    finally:
        processes.send(pid, signal.SIGCONT)
    return fault, signalled
