"""LocalDaemon: a real `tokend serve` on free loopback ports, for end-to-end tests and benchmarks; always cleaned up."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from common.exit_codes import EXIT_CONFIG_ERROR
from daemon.admin_token import read_admin_token
from frontend.usage_ledger import LEDGER_FILE, connect
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]  # tests/harness/ -> the repository


_NOTABLE_LINES = 60


def _is_notable(line: str) -> bool:
    """A warning or error record, or text that is not a record at all (a traceback, a library's own output)."""
    if not line.startswith("{"):
        return bool(line.strip())
    return '"level": "info"' not in line and '"level": "debug"' not in line


START_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The daemon could not listen on a port picked for it: another process took it meanwhile."""


def start_on_free_ports(start: Callable[[], None], pick_new_ports: Callable[[], None]) -> None:
    """Runs `start` until it does not raise PortTaken, picking new ports in between, at most START_ATTEMPTS times. A
    port picked free can be taken before the process binds it: the picks come from the ephemeral range, which every
    outgoing connection draws on too."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            start()
            return
        except PortTaken:
            if attempt == START_ATTEMPTS:
                raise
            pick_new_ports()


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all are held open until all are picked, so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def _model_flags(flags: tuple[str, ...], env: dict[str, str]) -> list[str]:
    """`--model tokend-tiny-random`, unless the caller chose the model: a --model flag, $TOKEND_MODEL, or a
    --config file with `model` or [[models]]. Tests and benchmarks want a model quick to load and to run, where
    the real default (SmolLM2-135M-Instruct) would cost seconds per daemon."""
    if "TOKEND_MODEL" in env or any(f == "--model" or f.startswith("--model=") for f in flags):
        return []
    if config_file_says(flags, lambda config: bool({"model", "models"} & set(config))):
        return []
    return ["--model", TINY_RANDOM_MODEL_NAME]


def config_file_says(flags: tuple[str, ...], predicate) -> bool:
    """Whether the --config file among `flags` satisfies `predicate` (its parsed TOML); True for a file that cannot
    be read, so that callers add nothing to a config the daemon itself will report."""
    for index, flag in enumerate(flags):
        path = flag.removeprefix("--config=") if flag.startswith("--config=") else None
        if flag == "--config" and index + 1 < len(flags):
            path = flags[index + 1]
        if path is not None:
            try:
                with open(path, "rb") as file:
                    return bool(predicate(tomllib.load(file)))
            except (OSError, tomllib.TOMLDecodeError):
                return True
    return False


_MUTATING_ADMIN = ("/tokend.v1.Admin/Drain", "/tokend.v1.Admin/Rollout")


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class _LocalAdminToken(grpc.UnaryUnaryClientInterceptor):
    """Attaches the daemon's local admin token to Drain/Rollout calls with no authorization of their own, as
    `tokend rollout` does, while the daemon has no tenants."""

    def __init__(self, daemon):
        self._daemon = daemon

    def intercept_unary_unary(self, continuation, details, request):
        metadata = list(details.metadata or ())
        wants_token = details.method in _MUTATING_ADMIN and not any(k == "authorization" for k, _ in metadata)
        if wants_token and not self._daemon.has_tenants:
            token = read_admin_token(self._daemon.state_dir)
            if token:
                metadata.append(("authorization", f"Bearer {token}"))
                details = _CallDetails(details.method, details.timeout, metadata, details.credentials,
                                       details.wait_for_ready, details.compression)  # fmt: skip
        return continuation(details, request)


class LocalDaemon:
    """One `tokend serve` process tree. Use as a context manager; it is killed, whole, on exit. It serves
    tokend-tiny-random unless the flags, the environment or the config file name a model."""

    def __init__(
        self, *flags: str, ready_timeout: float = 120.0, env: dict[str, str] | None = None, host: str = "127.0.0.1"
    ):
        self.host = host  # a loopback address: the tests and benchmarks reach it from here
        self.grpc_port, self.metrics_port, self.http_port = free_ports(3)
        self.state_dir = tempfile.mkdtemp(prefix="tokend-test-state-")
        self.log_path = Path(self.state_dir) / "daemon.log"
        self.flags = flags
        self.extra_env = env or {}
        self.ready_timeout = ready_timeout
        self.process: subprocess.Popen | None = None
        self.channel: grpc.Channel | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        """The gateway's base URL (OpenAI clients add /v1 themselves only if given it: use http_url + "/v1")."""
        return f"http://{self.host}:{self.http_port}"

    def __enter__(self) -> LocalDaemon:
        """Starts the daemon and waits until it serves; where a port was taken before the daemon bound it (it exits
        78 naming it), again on new ports."""
        start_on_free_ports(self._start, self._pick_new_ports)
        return self

    def _pick_new_ports(self) -> None:
        self.grpc_port, self.metrics_port, self.http_port = free_ports(3)

    def _start(self) -> None:
        command = [
            sys.executable, "-m", "daemon.cli", "serve",
            "--grpc-port", str(self.grpc_port),
            "--metrics-port", str(self.metrics_port),
            "--http-port", str(self.http_port),
            "--state-dir", self.state_dir,
            "--host", self.host,
        ]  # fmt: skip
        env = {**os.environ, **self.extra_env, "PYTHONPATH": str(ROOT)}
        command += [*_model_flags(self.flags, env), *self.flags]
        with self.log_path.open("wb") as log:
            # Its own session, so that cleanup can kill the whole tree whatever state it is in.
            self.process = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        self.channel = grpc.insecure_channel(self.address)
        try:
            self.wait_serving(self.ready_timeout)
            self.wait_for(self.gateway_is_serving, timeout=self.ready_timeout)
        except RuntimeError as error:
            self._stop()
            if self.process.returncode == EXIT_CONFIG_ERROR and "Address already in use" in str(error):
                raise PortTaken(str(error)) from None
            shutil.rmtree(self.state_dir, ignore_errors=True)
            raise
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> None:
        if exc[0] is not None and self.log_path.exists():  # pytest shows a failed test's stderr
            print(f"tokend serve's log ({exc[0].__name__} in its context):\n{self.failure_report()}", file=sys.stderr)
        self._stop()
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def _stop(self) -> None:
        """The daemon's process tree stopped (SIGTERM, then SIGKILL), its channel closed; its state kept."""
        if self.channel is not None:
            self.channel.close()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # anything left of the tree
            self.process.wait()

    # -- clients --------------------------------------------------------------------------------------------

    @property
    def generation(self) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(self.channel)

    @functools.cached_property
    def has_tenants(self) -> bool:
        """A keyless GetLoad is refused only when the daemon authenticates tenants."""
        try:
            pb_grpc.AdminStub(self.channel).GetLoad(pb.GetLoadRequest(), timeout=10)
        except grpc.RpcError as error:
            return error.code() == grpc.StatusCode.UNAUTHENTICATED
        return False

    @property
    def admin(self) -> pb_grpc.AdminStub:
        """Admin calls as `tokend rollout` makes them: with the daemon's local admin token while it has no tenants."""
        return pb_grpc.AdminStub(grpc.intercept_channel(self.channel, _LocalAdminToken(self)))

    def health_status(self) -> int | None:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
        except grpc.RpcError:
            return None

    def gateway_is_serving(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.health_status() != health_pb2.HealthCheckResponse.SERVING:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokend serve exited with {self.process.returncode}:\n{self.failure_report()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tokend serve not serving after {timeout} s:\n{self.failure_report()}")
            time.sleep(0.1)

    def generate(self, prompt: str = "Hello", timeout: float = 60.0, **sampling) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(**sampling))
        return list(self.generation.Generate(request, timeout=timeout))

    def metric(self, name: str, **labels: str) -> float:
        """A /metrics sample (e.g. 'tokend:num_requests_running'), summed over the series matching the labels."""
        text = urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/metrics", timeout=5).read().decode()
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    @contextlib.contextmanager
    def ledger(self):
        """A read-only connection to this daemon's usage ledger (rows as sqlite3.Row), closed on exit."""
        with contextlib.closing(connect(Path(self.state_dir) / LEDGER_FILE, read_only=True)) as connection:
            connection.row_factory = sqlite3.Row
            yield connection

    def usage_report(self, *flags: str) -> dict[str, dict[str, int]]:
        """Totals per tenant as `tokend usage --json` prints them from this daemon's ledger (flags: --since)."""
        command = [sys.executable, "-m", "daemon.cli", "usage", "--state-dir", self.state_dir, "--json", *flags]
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
        return json.loads(result.stdout)["tenants"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def failure_report(self) -> str:
        """For a failure's message: the log's warnings, errors and tracebacks, which a busy daemon's info lines
        would push out of the tail, then the tail."""
        text = self.log_path.read_text(errors="replace")
        notable = [line for line in text.splitlines() if _is_notable(line)][-_NOTABLE_LINES:]
        return "warnings and errors:\n" + "\n".join(notable) + "\nthe log's tail:\n" + text[-5000:]

    def log_entries(self, event: str | None = None, **fields) -> list[dict]:
        """The daemon's structured log records so far (with this event and these field values, if given).

        Only whole lines are read: a record still being written is left for the next call. Text that is not a
        record (an interpreter's traceback) is skipped; a record that does not parse fails loudly."""
        text = self.log_path.read_text(errors="replace")
        entries = []
        for line in text[: text.rfind("\n") + 1].splitlines():
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if (event is None or entry.get("event") == event) and all(entry.get(k) == v for k, v in fields.items()):
                entries.append(entry)
        return entries

    # -- the process tree -----------------------------------------------------------------------------------

    def child_pids(self, title: str) -> list[int]:
        """Pids of processes in this daemon's session whose title starts with `title`."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getsid(int(entry.name)) != self.process.pid:
                    continue
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (ProcessLookupError, FileNotFoundError, PermissionError):
                continue
            if cmdline.startswith(title):
                pids.append(int(entry.name))
        return pids

    def session_pids(self) -> list[int]:
        return self.child_pids("")

    def runtime_dir(self) -> Path:
        """The private directory of the daemon's ipc sockets (from its `starting` log line)."""
        for entry in self.log_entries("starting"):
            return Path(entry["runtime_dir"])
        raise AssertionError(f"no starting line in the log:\n{self.failure_report()}")

    def wait_for(self, predicate, timeout: float, interval: float = 0.05):
        """Polls predicate() until it returns something truthy; returns it, or fails after timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s:\n{self.failure_report()}")
            time.sleep(interval)
