"""The `tokend serve` process: spawns the frontend and one scheduler per GPU group, keeps them alive, drains.

It never imports torch: a supervisor must stay small and start fast. Children die with it (PDEATHSIG).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

from common.exit_codes import EXIT_CANNOT_SERVE, EXIT_CONFIG_ERROR
from daemon.children import Child
from daemon.config import ServeConfig
from daemon.listeners import banner, listeners_of
from daemon.systemd_notify import SystemdNotifier
from frontend.gateway.spec import GatewaySpec
from frontend.spec import METRICS_SOCKET_FILE, FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.peer_auth import SECRET_FILE, write_secret
from gpu_runtime.worker.spec import WorkerSpec

_TICK_S = 0.1
_HEALTH_PROBE_EVERY_S = 0.25
_MAX_CONSECUTIVE_FAILURES = 8  # then the daemon gives up and exits non-zero, for systemd to restart it


class Supervisor:
    def __init__(self, config: ServeConfig, log):
        self.config = config
        self.log = log
        self.notifier = SystemdNotifier()
        Path(config.state_dir).mkdir(parents=True, exist_ok=True)
        # A private directory (mkdtemp makes it 0700): only the service user can reach the ipc sockets.
        self.runtime_dir = Path(tempfile.mkdtemp(prefix="tokend-", dir=_systemd_runtime_dir()))
        # A new secret every boot, before any child exists: each child proves its hellos with it (peer_auth).
        write_secret(self.runtime_dir)
        self.schedulers = self._scheduler_children()
        self.frontend = self._frontend_child()
        self.gateway = self._gateway_child() if config.http_port else None
        self._stop_requested = False
        self._serving = False

    @property
    def children(self) -> list[Child]:
        return [*self.schedulers, self.frontend, *([self.gateway] if self.gateway else [])]

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        self.log.info("starting", runtime_dir=str(self.runtime_dir), schedulers=[c.name for c in self.schedulers])
        if not self.config.tenants:
            self.log.warning(
                "AUTHENTICATION_IS_OFF",
                detail="no [[tenants]] in the config: anyone who reaches the gRPC or HTTP port may use every model",
            )
        else:
            self.log.info("authentication_on", tenants=[t.name for t in self.config.tenants])
        try:
            for child in self.children:
                child.start()
            exit_code = self._supervise()
        finally:
            self._shut_down()
            shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.log.info("stopped", exit_code=exit_code)
        return exit_code

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True

    # -- the watch loop -------------------------------------------------------------------------------------

    def _supervise(self) -> int:
        next_probe = next_watchdog = 0.0
        while not self._stop_requested:
            now = time.monotonic()
            for child in self.children:
                if child.process is None:
                    if child.restart_at is not None and now >= child.restart_at:
                        self.log.info("restarting", child=child.name, restarts=child.num_restarts)
                        child.start()
                    continue
                code = child.poll()
                if code is None:
                    continue
                if code == EXIT_CONFIG_ERROR:  # the child logged why (a taken port, a bad model)
                    self.log.error("configuration_error", child=child.name)
                    return EXIT_CONFIG_ERROR
                if child.consecutive_failures >= _MAX_CONSECUTIVE_FAILURES:
                    self.log.error("cannot_serve", child=child.name, exit_code=code)
                    return EXIT_CANNOT_SERVE
                delay = child.schedule_restart(now)
                self.log.warning("child_exited", child=child.name, exit_code=code, restart_in_s=delay)
            self._kill_stalled_schedulers()
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

    def _kill_stalled_schedulers(self) -> None:
        now_wall = time.time()
        for child in self.schedulers:
            age = child.heartbeat_age(now_wall)
            if child.process is not None and age is not None and age > self.config.stall_timeout:
                self.log.error("scheduler_stalled", child=child.name, stalled_s=round(age))
                child.process.kill()  # the loop above reaps it and restarts it

    def _schedulers_progressing(self) -> bool:
        """True while every scheduler loop has moved recently (a hung engine must not look alive to systemd).

        A scheduler that is (re)starting is not progressing either: if it never gets to its loop, systemd's
        watchdog restarts the whole service."""
        now_wall = time.time()
        ages = [child.heartbeat_age(now_wall) for child in self.schedulers]
        return all(age is not None and age <= self.config.stall_timeout for age in ages)

    def _is_serving(self) -> bool:
        """Our own listeners are bound (so the probes below reach our processes, not whoever held a port before
        us), and every one answers as serving."""
        listening = self.frontend.is_listening and (self.gateway is None or self.gateway.is_listening)
        return listening and self._frontend_is_serving() and self._gateway_is_serving()

    def _announce_serving(self) -> None:
        self.notifier.ready()
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
        for child in self.schedulers:
            child.signal(signal.SIGTERM)
        for child in self.schedulers:
            child.stop(timeout=10.0)

    # -- children -------------------------------------------------------------------------------------------

    def _scheduler_children(self) -> list[Child]:
        return [
            Child(
                f"scheduler {spec.worker_id}",
                "gpu_runtime.worker",
                spec.to_json(),
                heartbeat_path=Path(spec.heartbeat_path),
                # Its GPUs only: its engine's "cuda:0" is the first, and no other GPU is within its reach.
                env={} if spec.cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": spec.cuda_visible_devices},
            )
            for spec in scheduler_specs(self.config, self.runtime_dir)
        ]

    def _frontend_child(self) -> Child:
        workers = [WorkerSpec.from_json(child.spec_json) for child in self.schedulers]
        spec = frontend_spec(self.config, self.runtime_dir, workers)
        return Child("frontend", "frontend", spec.to_json(), listening_path=Path(spec.listening_path))

    def _gateway_child(self) -> Child:
        spec = GatewaySpec(
            grpc_address=self.config.local_address(self.config.grpc_port),
            http_port=self.config.http_port,
            host=self.config.host,
            shutdown_timeout_s=5.0,  # by the time it is stopped, the frontend has drained
            header_timeout_s=self.config.http_header_timeout,
            max_connections=self.config.http_max_connections,
            log_level=self.config.log_level,
            listening_path=str(self.runtime_dir / "gateway.listening"),
            metrics_socket=str(self.runtime_dir / METRICS_SOCKET_FILE),
            metrics_token_sha256=self.config.metrics_token_sha256,
        )
        return Child("gateway", "frontend.gateway", spec.to_json(), listening_path=Path(spec.listening_path))


def scheduler_specs(config: ServeConfig, runtime_dir: Path) -> list[WorkerSpec]:
    """One WorkerSpec per scheduler: each model on each of its groups, with the config's engine options, the model's
    own share of a GPU, and that scheduler's identity (model, served name, device as its process sees it)."""
    specs = []
    served = config.served_models()
    placements = config.scheduler_placements()
    threads = config.scheduler_threads(len(placements))
    groups_of_model: dict[int, int] = {}
    for placement in placements:
        model = served[placement.model_index]
        group = groups_of_model.get(placement.model_index, 0)
        groups_of_model[placement.model_index] = group + 1
        slot = f"{placement.model_index}-{group}"
        engine = msgspec.structs.replace(config.engine_of(model), device=placement.engine_device)
        specs.append(
            WorkerSpec(
                worker_id=f"{model.name}/{group}",
                group=str(group),
                input_address=f"ipc://{runtime_dir}/scheduler-{slot}.ipc",
                output_address=f"ipc://{runtime_dir}/frontend.ipc",
                heartbeat_path=str(runtime_dir / f"scheduler-{slot}.alive"),
                secret_path=str(runtime_dir / SECRET_FILE),
                engine=engine,
                log_level=config.log_level,
                cpu_threads=threads,
                cuda_visible_devices=placement.cuda_visible_devices,
                devices=placement.label,
            )
        )
    return specs


def frontend_spec(config: ServeConfig, runtime_dir: Path, workers: list[WorkerSpec]) -> FrontendSpec:
    """The frontend's spec: where each scheduler listens, the models' names, and the admission options as given."""
    served = config.served_models()
    return FrontendSpec(
        grpc_port=config.grpc_port,
        host=config.host,
        metrics_port=config.metrics_port or None,
        output_address=f"ipc://{runtime_dir}/frontend.ipc",
        schedulers=[
            SchedulerAddress(w.worker_id, w.engine.served_model_name or "", w.group, w.input_address) for w in workers
        ],
        default_model=served[0].name,
        secret_path=str(runtime_dir / SECRET_FILE),
        liveness_timeout_s=config.liveness_timeout,
        aliases={alias: m.name for m in served for alias in m.aliases},
        drain_timeout_s=config.drain_timeout,
        log_level=config.log_level,
        tenants=list(config.tenants),
        state_dir=config.state_dir,
        admission=config.admission,
        tenant_metrics=config.tenant_metrics,
        metrics_token_sha256=config.metrics_token_sha256,
        listening_path=str(runtime_dir / "frontend.listening"),
        metrics_socket=str(runtime_dir / METRICS_SOCKET_FILE),
    )


def _systemd_runtime_dir() -> str | None:
    # systemd's RuntimeDirectory= sets $RUNTIME_DIRECTORY; elsewhere the system temporary directory.
    value = os.environ.get("RUNTIME_DIRECTORY")
    return value.split(":")[0] if value else None
