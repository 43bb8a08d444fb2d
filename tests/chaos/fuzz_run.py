"""The fuzz phase: each surface's inputs in turn, with canaries between them and, when a canary fails, a recorded
recovery (wait, then restart the suspected process) so that one broken receiver does not end the run."""

from __future__ import annotations

import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from harness.local_daemon import LocalDaemon
from hypothesis import strategies as st

from chaos import processes
from chaos.canary import Canary
from chaos.daemon_log import LogTail
from chaos.hypothesis_run import run_examples
from chaos.junk import shown
from chaos.report import Outcome, Report

MAX_RECOVERIES_PER_SURFACE = 2  # after that the surface's remaining inputs are skipped (and counted as skipped)
_TRANSIENT_WAIT_S = 10.0
_RECENT = 40


@dataclass(slots=True)
class Surface:
    name: str
    strategy: st.SearchStrategy
    send: Callable[[object], Outcome]
    count: int
    canary_every: int
    suspects: tuple[str, ...]  # the processes to restart, in order, when a canary fails after its inputs
    family: Callable[[object], str] = lambda value: "input"


class FuzzSession:
    def __init__(
        self,
        daemon: LocalDaemon,
        canary: Canary,
        report: Report,
        deadline: float,
        recovery_bound_s: float,
        on_input: Callable[[], None],
    ):
        self.daemon = daemon
        self.canary = canary
        self.report = report
        self.deadline = deadline  # time.monotonic() after which inputs are skipped
        self.recovery_bound_s = recovery_bound_s
        self.on_input = on_input
        self.broken = False  # the daemon could not be brought back: nothing more is sent
        self._recent: list[tuple[str, str]] = []
        self._recoveries: Counter = Counter()
        self._since_canary = 0
        self._log = LogTail(daemon.log_path)

    def run(self, surface: Surface, seed: int) -> None:
        self._recent.clear()
        self._since_canary = 0
        try:
            run_examples(surface.strategy, surface.count, seed, lambda value: self._one(surface, value))
        except Exception:  # hypothesis gave up generating: the other surfaces still run
            self.report.note_harness_error(traceback.format_exc())
        if self._since_canary and not self._skipping(surface):
            self._checkpoint(surface)

    def _skipping(self, surface: Surface) -> bool:
        return (
            self.broken
            or time.monotonic() > self.deadline
            or self._recoveries[surface.name] >= MAX_RECOVERIES_PER_SURFACE
        )

    def _one(self, surface: Surface, value: object) -> None:
        self.on_input()
        if self._skipping(surface):
            self.report.skip(surface.name)
            return
        try:
            outcome = surface.send(value)
        except Exception as error:  # a bug of this script, or a client library surprised: shown, never fatal
            outcome = Outcome(f"harness error: {type(error).__name__}")
            self.report.note_harness_error(traceback.format_exc())
        self.report.record(surface.name, outcome, shown(value))
        self._recent = [*self._recent[-_RECENT + 1 :], (surface.family(value), shown(value, 400))]
        for signature in self._log.new_errors():  # logged a moment after its input, hence the two last
            self.report.note_logged_error(signature, surface.name, [text for _, text in self._recent[-2:]])
        self._since_canary += 1
        if outcome.loss == "hung" or self._since_canary >= surface.canary_every:
            self._checkpoint(surface)

    def _checkpoint(self, surface: Surface) -> None:
        self._since_canary = 0
        ok, detail = self.canary.check()
        if ok:
            self._recent.clear()
            return
        families = Counter(family for family, _ in self._recent)
        inputs = " | ".join(text for _, text in self._recent[-3:])
        self.report.lose(
            "canary_failed",
            surface.name,
            "canary failed",
            f"{detail}; inputs since the last good canary, by kind: {dict(families)}",
            inputs,
        )
        self._recover(surface, detail)
        self._recent.clear()

    def _recover(self, surface: Surface, canary_detail: str) -> None:
        """Waits for the daemon to come back by itself; else restarts the suspects one by one until it serves."""
        self._recoveries[surface.name] += 1
        started = time.monotonic()
        action, recovered = "waited", self.canary.wait_recovered(started, _TRANSIENT_WAIT_S)
        for kind in surface.suspects if recovered is None else ():
            pid = processes.pid_of(self.daemon, kind, timeout=10)
            if pid is not None:
                processes.kill(kind, pid, time.monotonic() + processes.MIN_AGE_BEFORE_KILL_S)
            action = f"killed the {kind} (pid {pid})"
            recovered = self.canary.wait_recovered(time.monotonic(), self.recovery_bound_s)
            if recovered is not None:
                break
        self.report.recoveries.append(
            {
                "surface": surface.name,
                "after_inputs": self.report.inputs_tried[surface.name],
                "canary": canary_detail[:300],
                "action": action,
                "serving_again_after_s": None if recovered is None else round(time.monotonic() - started, 1),
            }
        )
        if recovered is None:
            self.broken = True
            self.report.lose("not_recovered", surface.name, action, "the daemon did not serve again; fuzzing stopped")
