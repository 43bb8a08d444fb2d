"""The end-to-end tests' daemon: daemon.local_daemon's LocalDaemon, under the name the tests use, and a gateway
run alone (`tokend gateway`) in front of one."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import httpx

from daemon.local_daemon import ROOT, free_port
from daemon.local_daemon import LocalDaemon as Daemon

__all__ = ["ROOT", "Daemon", "free_port", "standalone_gateway"]


@contextlib.contextmanager
def standalone_gateway(daemon: Daemon, *flags: str):
    """`tokend gateway --address <the daemon's>` on a free port until the block ends; yields its base URL."""
    port = free_port()
    command = [sys.executable, "-m", "daemon.cli", "gateway", "--address", daemon.address, "--http-port", str(port)]
    gateway = subprocess.Popen([*command, *flags], cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        daemon.wait_for(lambda: _answers(f"{url}/health"), timeout=30)
        yield url
    finally:
        gateway.terminate()
        gateway.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
