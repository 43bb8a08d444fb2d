"""A supervised child process: how to start it, when it may restart, and how to stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.exit_codes import EXIT_CONFIG_ERROR

MAX_CONSECUTIVE_FAILURES = 8  # then the daemon gives up on the child (or a rollout on its new weights)
_PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
_STABLE_AFTER_S = 30.0  # a child up this long has recovered: its backoff starts over
_MAX_BACKOFF_S = 30.0


@dataclass(eq=False)
class Child:
    """One process the daemon keeps alive: started with `python -m <module> <spec>`, the spec's JSON or the path of
    a private file holding it (the frontend's and gateway's: tenant key hashes stay out of argv)."""

    name: str  # e.g. "frontend", "scheduler tokend-tiny-random/0"
    module: str
    spec_json: str  # the command-line argument: JSON, or a spec file's path
    heartbeat_path: Path | None = None  # schedulers touch it while their loop runs
    listening_path: Path | None = None  # the frontend and gateway create it once their listeners are bound
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    consecutive_failures: int = 0
    restart_at: float | None = None  # when a crashed child is due to start again
    num_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self, now: float | None = None) -> None:
        env = dict(os.environ, **self.env)
        # Children import this project's packages whatever the working directory or installation.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PROJECT_ROOT, env.get("PYTHONPATH")]))
        # The process title goes in argv's space alone (which the spec JSON makes ample), not over the environment,
        # so that /proc/<pid>/environ still shows what the child was given (a scheduler's CUDA_VISIBLE_DEVICES).
        env["SPT_NOENV"] = "1"
        # The new process creates them again: until then it is starting, neither progressing nor listening.
        for marker in (self.heartbeat_path, self.listening_path):
            if marker is not None:
                marker.unlink(missing_ok=True)
        self.process = subprocess.Popen([sys.executable, "-m", self.module, self.spec_json], env=env)
        self.started_at = time.monotonic() if now is None else now
        self.restart_at = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        """The exit code if the child has exited (it is reaped), else None."""
        return self.process.poll() if self.process else None

    def schedule_restart(self, now: float, recovered: bool | None = None) -> float:
        """Backs off 0.5 s, 1 s, 2 s ... up to 30 s between failures; returns the delay. `recovered`: whether the
        run that ended counts as a recovery (its failures start over); None: whether it was up long enough."""
        if recovered is None:
            recovered = now - self.started_at >= _STABLE_AFTER_S
        if recovered:
            self.consecutive_failures = 0
        self.consecutive_failures += 1
        delay = min(_MAX_BACKOFF_S, 0.5 * 2 ** (self.consecutive_failures - 1))
        self.restart_at = now + delay
        self.process = None
        self.num_restarts += 1
        return delay

    # -- the back-off, the same for the frontend, the gateway and every scheduler -----------------------------

    def restart_due(self, now: float) -> bool:
        """It crashed and its back-off is over."""
        return self.process is None and self.restart_at is not None and now >= self.restart_at

    def restart(self, now: float, log) -> None:
        log.info("restarting", child=self.name, restarts=self.num_restarts)
        self.start(now)

    def give_up_reason(self, exit_code: int) -> str | None:
        """Why this exit is its last: "configuration_error" (it said its configuration cannot work: a taken port,
        a bad model) or "cannot_serve" (it failed MAX_CONSECUTIVE_FAILURES times in a row); None: it restarts."""
        if exit_code == EXIT_CONFIG_ERROR:
            return "configuration_error"
        if self.consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            return "cannot_serve"
        return None

    def back_off(self, exit_code: int, now: float, log, recovered: bool | None = None) -> None:
        """It exited and is to start again once its back-off is over."""
        delay = self.schedule_restart(now, recovered)
        log.warning("child_exited", child=self.name, exit_code=exit_code, restart_in_s=delay)

    @property
    def is_listening(self) -> bool:
        """True once this incarnation said its listeners are bound (always, for a child that has none)."""
        return self.listening_path is None or self.listening_path.exists()

    def heartbeat_age(self, now_wall: float) -> float | None:
        """Seconds since the child's loop last moved; None while it has not started looping (loading a model)."""
        if self.heartbeat_path is None:
            return 0.0
        try:
            return now_wall - self.heartbeat_path.stat().st_mtime
        except FileNotFoundError:
            return None

    def signal(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after the timeout; always reaps."""
        if self.process is None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
