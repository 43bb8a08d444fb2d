"""The end-to-end tests' daemon: daemon.local_daemon's LocalDaemon, under the name the tests use."""

from daemon.local_daemon import ROOT, free_port
from daemon.local_daemon import LocalDaemon as Daemon

__all__ = ["ROOT", "Daemon", "free_port"]
