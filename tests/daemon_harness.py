"""The end-to-end tests' daemon: daemon.local_daemon's LocalDaemon on the CPU unless a test names a device, and a
gateway run alone (`tokend gateway`) in front of one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import httpx

from daemon.local_daemon import ROOT, LocalDaemon, config_file_says, free_port

__all__ = ["ROOT", "Daemon", "free_port", "standalone_gateway"]


class Daemon(LocalDaemon):
    """A LocalDaemon given `--device cpu` unless the test names a device (a --device flag, $TOKEND_DEVICE, a config
    file's `device` or its models' `groups`): the suite's references are float32 CPU outputs, which a daemon on a
    GPU box's default device (bfloat16 on CUDA) would not match. The conftest hides CUDA from its processes too."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, **options):
        names_device = "TOKEND_DEVICE" in {**os.environ, **(env or {})} or _flags_name_device(flags)
        super().__init__(*(flags if names_device else ("--device", "cpu", *flags)), env=env, **options)


def _flags_name_device(flags: tuple[str, ...]) -> bool:
    if any(f == "--device" or f.startswith("--device=") for f in flags):
        return True
    return config_file_says(
        flags, lambda config: "device" in config or any(m.get("groups") for m in config.get("models", []))
    )


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
