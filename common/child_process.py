"""What every process `tokend serve` spawns does first: take its title, and die with its parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

import setproctitle

_PR_SET_PDEATHSIG = 1


def become_child(title: str, death_signal: signal.Signals = signal.SIGTERM) -> None:
    """Sets the process title (`ps` shows e.g. `tokend: frontend`) and asks Linux for `death_signal` when the
    parent dies, so that a killed daemon never leaves orphans holding a GPU."""
    setproctitle.setproctitle(title)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, death_signal)
        if os.getppid() == 1:  # the parent died before prctl took effect
            sys.exit(1)
