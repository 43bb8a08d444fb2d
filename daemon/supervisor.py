"""The `tokend serve` process: spawns the frontend, the gateway and the worker set, keeps them alive, drains.

It never imports torch: a supervisor must stay small and start fast. Children die with it (PDEATHSIG). The worker
set (daemon.worker_pool) is reconciled here, one action per tick, and published to the frontend over the control
channel, which also brings operators' rollout commands in.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from common.exit_codes import EXIT_CANNOT_SERVE, EXIT_CONFIG_ERROR
from common.lanes import DrainAction
from daemon.admin_token import write_admin_token
from daemon.child_specs import frontend_spec, gateway_spec, write_spec_file
from daemon.children import Child
from daemon.config import ServeConfig
from daemon.control_channel import ControlChannel
from daemon.listeners import banner, listeners_of
from daemon.rollout_commands import handle_rollout
from daemon.systemd_notify import SystemdNotifier
from daemon.worker_pool import CannotServe, ChildFactory, WorkerPool
from frontend.control_messages import (
    ControlHello,
    LiveLinks,
    RolloutCommand,
    ScaleCommand,
    TenantsApplied,
    TenantsUpdate,
    WorkerSet,
)
from gpu_runtime.ipc.peer_auth import read_secret, write_secret

_TICK_S = 0.1
_HEALTH_PROBE_EVERY_S = 0.25
_TENANTS_RESEND_S = 1.0


class Supervisor:
    def __init__(self, config: ServeConfig, log, reload_config: Callable[[], ServeConfig] | None = None,
                 make_child: ChildFactory = Child):  # fmt: skip
        self.config = config
        self._make_child = make_child
        self.log = log
        self._reload_config = reload_config  # SIGHUP reads the configuration again through it
        self.notifier = SystemdNotifier()
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        # A new local admin token every boot (Drain and Rollout need it while there are no tenants).
        self._admin_token_sha256 = write_admin_token(config.state_dir)
        # A private directory (mkdtemp makes it 0700): only the service user can reach the ipc sockets.
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="tokend-", dir=_systemd_runtime_dir()))
        # A new secret every boot, before any child exists: each child proves its hellos with it (peer_auth).
        secret_path = write_secret(self.runtime_dir)
        self.pool = WorkerPool(config, self.runtime_dir, log, make_child)
        self.control = ControlChannel(self.runtime_dir, read_secret(secret_path), log)
        self.frontend = self._frontend_child()
        self.gateway = self._gateway_child() if config.http_port else None
        self._stop_requested = False
        self._reload_requested = False
        self._serving = False
        self._published_version = -1
        # SIGHUP's tenants, versioned: sent until the frontend acknowledges them (0: the configuration's own,
        # which a frontend starts with), so a replay of an old update is refused and a lost one is sent again.
        self._tenants_version = self._tenants_applied = 0
        self._tenants_resend_at = 0.0
        # The tenants version whose acknowledgement ends the reload systemd was told of (None: none under way).
        self._reload_done_at_version: int | None = None

    @property
    def children(self) -> list[Child]:
        """The frontend and the gateway: the workers are the pool's."""
        return [self.frontend, *([self.gateway] if self.gateway else [])]

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        signal.signal(signal.SIGHUP, self._request_reload)
        workers = [w.spec.worker_id for w in self.pool.workers]
        self.log.info("starting", runtime_dir=str(self.runtime_dir), schedulers=workers)
        if not self.config.tenants:
            self.log.warning(
                "AUTHENTICATION_IS_OFF",
                detail="no [[tenants]] in the config: anyone who reaches the gRPC or HTTP port may use every model",
            )
        else:
            self.log.info("authentication_on", tenants=[t.name for t in self.config.tenants])
        try:
            self.pool.start_all()
            for child in self.children:
                child.start()
            exit_code = self._supervise()
        finally:
            self._shut_down()
            self.control.close()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.log.info("stopped", exit_code=exit_code)
        return exit_code

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True

    def _request_reload(self, signum, frame) -> None:
        self._reload_requested = True

    # -- the watch loop -------------------------------------------------------------------------------------

    def _supervise(self) -> int:
        next_probe = next_watchdog = 0.0
        while not self._stop_requested:
            now = time.monotonic()
            exit_code = self.watch_children(now)
            if exit_code is not None:
                return exit_code
            try:
                self.pool.tick(now)
            except CannotServe as error:
                return EXIT_CONFIG_ERROR if error.exit_code == EXIT_CONFIG_ERROR else EXIT_CANNOT_SERVE
            self._kill_stalled_schedulers()
            self._serve_control_channel()
            if self._reload_requested:
                self._reload_requested = False
                self._reload_tenants()
            if not self._serving and now >= next_probe:
                next_probe = now + _HEALTH_PROBE_EVERY_S
                if self._is_serving():
                    self._serving = True
                    self._announce_serving()
            interval = self.notifier.watchdog_interval_s
            if interval and now >= next_watchdog and self._schedulers_progressing():
                next_watchdog = now + interval
                self.notifier.watchdog()
            time.sleep(_TICK_S)
        return 0

    def watch_children(self, now: float) -> int | None:
        """The frontend and the gateway: restarted after the same back-off as the workers; the daemon's exit code
        when one cannot serve (the child logged why: a taken port, a bad model)."""
        for child in self.children:
            if child.restart_due(now):
                child.restart(now, self.log)
            code = child.poll()
            if code is None:
                continue
            reason = child.give_up_reason(code)
            if reason is not None:
                self.log.error(reason, child=child.name, exit_code=code)
                return EXIT_CONFIG_ERROR if reason == "configuration_error" else EXIT_CANNOT_SERVE
            child.back_off(code, now, self.log)
        return None

    def _kill_stalled_schedulers(self) -> None:
        now_wall = time.time()
        for worker in self.pool.workers:
            child = worker.child
            age = child.heartbeat_age(now_wall)
            if child.process is not None and age is not None and age > self.config.stall_timeout:
                self.log.error("scheduler_stalled", child=child.name, stalled_s=round(age))
                child.process.kill()  # the pool reaps it and restarts it

    def _schedulers_progressing(self) -> bool:
        """True while every scheduler loop has moved recently (a hung engine must not look alive to systemd).

        A scheduler that is (re)starting is not progressing either: if it never gets to its loop, systemd's
        watchdog restarts the whole service. A rollout's new workers, loading for minutes, are the exception."""
        now_wall = time.time()
        ages = [child.heartbeat_age(now_wall) for child in self.pool.watched_children(self._serving)]
        return all(age is not None and age <= self.config.stall_timeout for age in ages)

    # -- the control channel --------------------------------------------------------------------------------

    def _serve_control_channel(self) -> None:
        for message in self.control.receive():
            if isinstance(message, ControlHello):
                self.log.info("frontend_connected", frontend_id=message.frontend_id)
                self._published_version = -1  # the whole set again, for a frontend that knows nothing
                self._tenants_applied = 0  # it starts with the configuration's own tenants
                self._tenants_resend_at = 0.0
                self.pool.frontend_links = frozenset()  # a new frontend: linked to nothing until it says
            elif isinstance(message, LiveLinks):
                self.pool.frontend_links = frozenset(message.worker_ids)
            elif isinstance(message, TenantsApplied):
                self._tenants_acknowledged(message.version)
            elif isinstance(message, ScaleCommand):
                if message.model_name in self.pool.rollouts:
                    self.pool.scale(message.model_name, message.serving, message.standby, message.reason, message.pool)
            elif isinstance(message, RolloutCommand):
                result = handle_rollout(self.pool, message)
                log = self.log.warning if result.error else self.log.info
                log("rollout_command", model=message.model_name, path=message.path, rollback=message.rollback,
                    strategy=message.strategy, canary_percent=message.canary_percent,
                    error=result.error or None)  # fmt: skip
                self.pool.tick(time.monotonic())  # its first action now, in the set the frontend gets next
                self._publish()
                self.control.send(result)
        self._publish()
        self._send_tenants()

    def _send_tenants(self) -> None:
        """The reloaded tenants, once a second until the frontend says it applied them."""
        now = time.monotonic()
        if self._tenants_applied < self._tenants_version and now >= self._tenants_resend_at:
            self._tenants_resend_at = now + _TENANTS_RESEND_S
            self.control.send(TenantsUpdate(self._tenants_version, list(self.config.tenants)))

    def _publish(self) -> None:
        if self._published_version == self.pool.version:
            return
        self._published_version = self.pool.version
        self.control.send(
            WorkerSet(
                self.pool.version,
                self.pool.infos(),
                self.pool.statuses(),
                self.config.rollout_drain_timeout,
                DrainAction(self.config.on_drain_timeout),
            )
        )

    def _reload_tenants(self) -> None:
        """SIGHUP: the tenants (keys, priorities, quotas) again from the configuration; a bad file changes nothing.
        systemd hears RELOADING=1 now and READY=1 once the frontend applied the tenants or the file was refused."""
        if self._serving:  # before the first READY=1, systemd is still waiting for the start to finish
            self.notifier.reloading()
        if self._reload_config is None:
            self._reload_refused("this daemon was not started from a configuration", self.log.warning)
            return
        from daemon.config_reload import reload_tenants

        try:
            reloaded = reload_tenants(self.config, self._reload_config)
        except (ValueError, TypeError) as error:
            self._reload_refused(str(error), self.log.error)
            return
        self.config = reloaded.config
        self.log.info("config_reloaded", changes=reloaded.changes, needs_restart=reloaded.needs_restart)
        self._tenants_version += 1
        self._tenants_resend_at = 0.0
        if self._serving:
            self._reload_done_at_version = self._tenants_version
        self._send_tenants()

    def _reload_refused(self, error: str, log) -> None:
        log("config_reload_refused", error=error, detail="the previous configuration stays")
        if self._serving:
            self.notifier.reloaded(f"serving; the configuration reload was refused: {error}"[:400])

    def _tenants_acknowledged(self, version: int) -> None:
        if version > self._tenants_applied:
            self.log.info("tenants_acknowledged", version=version)
        self._tenants_applied = max(self._tenants_applied, version)
        if self._reload_done_at_version is not None and self._tenants_applied >= self._reload_done_at_version:
            self._reload_done_at_version = None
            self.notifier.reloaded("serving; configuration reloaded")

    def _is_serving(self) -> bool:
        """Our own listeners are bound (so the probes below reach our processes, not whoever held a port before
        us), and every one answers as serving."""
        listening = self.frontend.is_listening and (self.gateway is None or self.gateway.is_listening)
        return listening and self._frontend_is_serving() and self._gateway_is_serving()

    def _announce_serving(self) -> None:
        listeners = listeners_of(self.config)
        self.log.info(
            "serving",
            host=self.config.host,
            grpc_port=self.config.grpc_port,
            http_port=self.config.http_port,
            metrics_port=self.config.metrics_port,
            urls={listener.key.removesuffix("_port"): listener.url for listener in listeners},
        )
        if sys.stderr.isatty():  # a person at a terminal: the JSON above is for the journal
            models = [model.name for model in self.config.served_models()]
            print(banner(models, listeners), file=sys.stderr, flush=True)
        self.notifier.ready()  # last: whoever waits for it finds the record above written

    def _frontend_is_serving(self) -> bool:
        import grpc  # only the supervisor's readiness probe needs it
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.config.local_address(self.config.grpc_port)) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _gateway_is_serving(self) -> bool:
        if self.gateway is None:
            return True
        try:
            url = f"http://{self.config.local_address(self.config.http_port)}/health"
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return reply.status == 200
        except OSError:  # refused, or an HTTP error status
            return False

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shut_down(self) -> None:
        """Frontend first: it drains in-flight streams, which need the schedulers (and the gateway, for the HTTP
        ones), and refuses new ones meanwhile (the gateway answers them 503). Then the gateway, then the schedulers."""
        self.notifier.stopping()
        self.log.info("draining", timeout_s=self.config.drain_timeout)
        self.frontend.stop(timeout=self.config.drain_timeout + 10.0)
        if self.gateway is not None:
            self.gateway.stop(timeout=10.0)
        self.pool.stop_all(timeout=10.0)

    # -- children -------------------------------------------------------------------------------------------

    def _frontend_child(self) -> Child:
        spec = frontend_spec(self.config, self.runtime_dir, [w.spec for w in self.pool.workers],
                             self._admin_token_sha256)  # fmt: skip
        spec_path = write_spec_file(self.runtime_dir, "frontend", spec.to_json())
        return self._make_child("frontend", "frontend", spec_path, listening_path=Path(spec.listening_path))

    def _gateway_child(self) -> Child:
        spec = gateway_spec(self.config, self.runtime_dir)
        spec_path = write_spec_file(self.runtime_dir, "gateway", spec.to_json())
        return self._make_child("gateway", "frontend.gateway", spec_path, listening_path=Path(spec.listening_path))


# An ipc:// socket's path must fit in sun_path (107 bytes and a NUL): the directory the private runtime directory is
# made in leaves room for mkdtemp's name and the longest socket file in it.
MAX_RUNTIME_PARENT_BYTES = 107 - len("/tokend-xxxxxxxx/kv-scheduler-999-99999.ipc")


def runtime_parent_problem() -> str | None:
    """Why the runtime directory's parent ($RUNTIME_DIRECTORY, else the temporary directory) cannot hold the ipc
    sockets, or None: checked before any process starts, since past the limit every bind fails."""
    parent = _systemd_runtime_dir() or tempfile.gettempdir()
    length = len(os.fsencode(parent))
    if length <= MAX_RUNTIME_PARENT_BYTES:
        return None
    where = "RUNTIME_DIRECTORY" if _systemd_runtime_dir() else "TMPDIR (the temporary directory)"
    return (
        f"{where}: {parent!r} is {length} bytes long; the ipc:// sockets made under it need it at most "
        f"{MAX_RUNTIME_PARENT_BYTES} bytes (a socket path must fit in 107): use a shorter one, e.g. /run/tokend"
    )


def _systemd_runtime_dir() -> str | None:
    # systemd's RuntimeDirectory= sets $RUNTIME_DIRECTORY; elsewhere the system temporary directory.
    value = os.environ.get("RUNTIME_DIRECTORY")
    return value.split(":")[0] if value else None
