"""The end-to-end tests' daemon: harness.local_daemon's LocalDaemon on the CPU unless a test names a device, and a
gateway run alone (`tokend gateway`) in front of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys

import httpx
from harness.local_daemon import ROOT, LocalDaemon, config_file_says, free_port

from tokend.v1 import tokend_pb2 as pb

__all__ = ["ROOT", "Daemon", "free_port", "standalone_gateway"]


class Daemon(LocalDaemon):
    """A LocalDaemon given `--device cpu` unless the test names a device (a --device flag, $TOKEND_DEVICE, a config
    file's `device` or its models' `groups`): the suite's references are float32 CPU outputs, which a daemon on a
    GPU box's default device (bfloat16 on CUDA) would not match. The conftest hides CUDA from its processes too."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None, **options):
        names_device = "TOKEND_DEVICE" in {**os.environ, **(env or {})} or _flags_name_device(flags)
        super().__init__(*(flags if names_device else ("--device", "cpu", *flags)), env=env, **options)

    def __exit__(self, *exc) -> None:
        """Killed, whole, at once (SIGKILL to its process group), with the runtime directory a drained exit would
        remove: a drained exit takes 3-4 s (the scheduler's threads and interpreter) and no test reads anything of
        it here. The tests of a graceful stop (test_serve_lifecycle, the chaos run) send SIGTERM themselves and
        assert the exit code before the block ends."""
        runtime_dir = None
        with contextlib.suppress(Exception):  # a daemon that never logged its start has no runtime directory
            runtime_dir = self.runtime_dir()
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
        super().__exit__(*exc)
        if runtime_dir is not None:
            shutil.rmtree(runtime_dir, ignore_errors=True)

    def steps_by_group(self, model: str) -> dict[str, float]:
        """Steps each of `model`'s schedulers (by GPU group, as Admin.GetLoad names them) has run since its warm-up,
        from /metrics' tokend:iteration_tokens: which workers took a share of the work."""
        load = self.admin.GetLoad(pb.GetLoadRequest(), timeout=10)
        groups = {s.group for s in load.schedulers if s.model == model}
        name = "tokend:iteration_tokens_total_count"
        return {group: self.metric(name, model_name=model, group=group) for group in groups}

    def wait_every_group_stepped(self, model: str, before: dict[str, float], timeout: float = 30) -> dict[str, float]:
        """Waits until every one of `model`'s schedulers has run steps since `before` (a steps_by_group reading):
        load reports reach /metrics a moment after the steps."""

        def stepped() -> dict[str, float] | None:
            now = self.steps_by_group(model)
            return now if now and all(count > before.get(group, 0) for group, count in now.items()) else None

        return self.wait_for(stepped, timeout=timeout)


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
