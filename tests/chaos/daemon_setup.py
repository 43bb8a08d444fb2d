"""The daemon under test: a LocalDaemon with three tenants (gRPC load, HTTP load, fuzz) and model_roots (optionally a
prefill and a decode worker), stopped before the audit."""

from __future__ import annotations

import contextlib
import hashlib
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.local_daemon import LocalDaemon

from chaos.processes import continue_all
from chaos.rollout_fuzz import make_roots

# One tenant per kind of traffic, so that the ledger audit can tell whose rows are whose (isolation included).
GRPC_TENANT, HTTP_TENANT, FUZZ_TENANT = "chaos-grpc", "chaos-http", "chaos-fuzz"
TENANTS = (GRPC_TENANT, HTTP_TENANT, FUZZ_TENANT)
DRAIN_TIMEOUT_S = 10.0
# A prefill and a decode worker (tests/test_disaggregated.py): long prompts are handed over on the KV socket.
PD_FLAGS = ("--device", "cpu=prefill,cpu=decode", "--disagg-min-prompt-tokens", "16")


@dataclass(frozen=True, slots=True)
class Tenants:
    keys: dict[str, str]  # tenant name -> API key

    def bearer(self, tenant: str) -> str:
        return f"Bearer {self.keys[tenant]}"

    def metadata(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", self.bearer(tenant)),)


def make_tenants(seed: int) -> Tenants:
    return Tenants(
        {name: f"sk-{name}-{seed}-{hashlib.sha256(f'{name}{seed}'.encode()).hexdigest()[:16]}" for name in TENANTS}
    )


def write_config(tenants: Tenants, directory: Path) -> Path:
    """The TOML file: the tenants (fuzz may ask for either priority), a short drain for a quick stop, and the
    model_roots the rollout surface aims around (rollout_fuzz.make_roots)."""
    lines = [f"drain_timeout = {DRAIN_TIMEOUT_S}", f'model_roots = ["{make_roots(directory).roots}"]']
    for name, key in tenants.keys.items():
        digest = hashlib.sha256(key.encode()).hexdigest()
        lines += ["", "[[tenants]]", f'name = "{name}"', f'api_key_sha256 = "{digest}"', 'max_priority = "interactive"']
    path = directory / "tokend-chaos.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def chaos_daemon(tenants: Tenants, pd: bool = False):
    """A started LocalDaemon serving the tenants (with `pd`, on a prefill and a decode worker); killed, whole, on
    exit. Its `chaos_dir` holds the config and the rollout surface's files."""
    with tempfile.TemporaryDirectory(prefix="tokend-chaos-") as directory:
        config = write_config(tenants, Path(directory))
        with LocalDaemon("--config", str(config), *(PD_FLAGS if pd else ())) as daemon:
            daemon.chaos_dir = Path(directory)
            yield daemon


def stop_daemon(daemon: LocalDaemon, timeout: float = DRAIN_TIMEOUT_S + 40.0) -> int | None:
    """SIGTERM and wait, as systemd stops it: the ledger is then final. Returns the exit code (None: killed)."""
    process = daemon.process
    if process is None or process.poll() is not None:
        return None if process is None else process.returncode
    continue_all(daemon)  # nothing may stay stopped, or the drain would wait on it
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def ledger_rows(daemon: LocalDaemon) -> tuple[list[dict], str | None]:
    """Every usage row, read-only, and why the ledger could not be read (None when it could)."""
    try:
        with daemon.ledger() as connection:
            return [dict(row) for row in connection.execute("SELECT * FROM usage ORDER BY started_at")], None
    except Exception as error:  # a missing or unreadable ledger is reported, not raised
        return [], repr(error)
