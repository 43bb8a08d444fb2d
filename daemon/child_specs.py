"""The specs the daemon starts its children with: each scheduler's WorkerSpec (on a slot), the frontend's, the
gateway's. A slot is one GPU group a scheduler can run on: each model's configured groups, then spare_devices."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import msgspec

from common.lanes import Role
from daemon.admin_token import ADMIN_TOKEN_FILE
from daemon.config import ModelSpec, ServeConfig
from frontend.control_messages import DAEMON_SOCKET_FILE, FRONTEND_SOCKET_FILE
from frontend.gateway.spec import GatewaySpec
from frontend.spec import METRICS_SOCKET_FILE, FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.peer_auth import SECRET_FILE
from gpu_runtime.worker.spec import WorkerSpec


@dataclass(eq=False)
class Slot:
    index: int
    group: str  # the name schedulers on it report: the model's group number ("0"), or "spare<N>"
    devices: str  # as configured: "cpu", "cuda:1"
    engine_device: str  # as its scheduler's engine names it ("cuda:0" under its CUDA_VISIBLE_DEVICES)
    cuda_visible_devices: str | None
    owner: str | None  # the model whose worker ran here last; None: a spare never used
    cpu_cores: tuple[int, ...] = ()  # a pinned CPU group's cores ("cpu@0-1"); empty: not pinned
    role: Role = Role.MIXED  # of the workers started here
    failed: bool = False  # a worker started here later could not serve: nothing is started here again


def slots_of(config: ServeConfig) -> list[Slot]:
    """Every model's groups (in the order of scheduler_placements), then the spare devices."""
    slots, groups_of_model = [], {}
    for placement in config.scheduler_placements():
        group = groups_of_model.get(placement.model_name, 0)
        groups_of_model[placement.model_name] = group + 1
        slots.append(Slot(len(slots), str(group), placement.label, placement.engine_device,
                          placement.cuda_visible_devices, placement.model_name, placement.cpu_cores,
                          placement.role))  # fmt: skip
    for number, placement in enumerate(config.spare_placements()):
        slots.append(Slot(len(slots), f"spare{number}", placement.label, placement.engine_device,
                          placement.cuda_visible_devices, None, placement.cpu_cores, placement.role))  # fmt: skip
    return slots


def worker_id_of(model_name: str, slot: Slot, epoch: int) -> str:
    return f"{model_name}/{slot.group}" if epoch == 0 else f"{model_name}/{slot.group}@{epoch}"


def worker_spec(
    config: ServeConfig, runtime_dir: Path, model: ModelSpec, slot: Slot, epoch: int, path: str | None
) -> WorkerSpec:
    """A scheduler of `model` on `slot` for rollout `epoch` (0: the daemon's start), loading the weights at `path`
    (None: the model's configured ones), with the config's engine options and the model's own share of a GPU."""
    engine = msgspec.structs.replace(config.engine_of(model), device=slot.engine_device)
    if path is not None:
        engine = msgspec.structs.replace(engine, model=path)
    name = f"scheduler-{slot.index}-{epoch}"  # one worker per slot and epoch at a time
    return WorkerSpec(
        worker_id=worker_id_of(model.name, slot, epoch),
        group=slot.group,
        input_address=f"ipc://{runtime_dir}/{name}.ipc",
        output_address=f"ipc://{runtime_dir}/frontend.ipc",
        heartbeat_path=str(runtime_dir / f"{name}.alive"),
        secret_path=str(runtime_dir / SECRET_FILE),
        engine=engine,
        log_level=config.log_level,
        cpu_threads=config.scheduler_threads(len(config.scheduler_placements()), slot.cpu_cores),
        cpu_cores=list(slot.cpu_cores),
        cuda_visible_devices=slot.cuda_visible_devices,
        devices=slot.devices,
        collective_timeout_s=config.stall_timeout,
        role=slot.role,
        kv_address=f"ipc://{runtime_dir}/kv-{name}.ipc",
        kv_lease_seconds=config.kv_lease_seconds,
        kv_load_failure=config.kv_load_failure,
        kv_transfer_transport=config.kv_transfer_transport,
    )


def scheduler_specs(config: ServeConfig, runtime_dir: Path) -> list[WorkerSpec]:
    """The schedulers the daemon starts with: each model on each of its groups, as "<model>/<group>"."""
    models = {model.name: model for model in config.served_models()}
    return [
        worker_spec(config, runtime_dir, models[slot.owner], slot, 0, None)
        for slot in slots_of(config)
        if slot.owner is not None
    ]


def write_spec_file(runtime_dir: Path, name: str, spec_json: str) -> str:
    """The spec in a 0600 file of the private runtime directory; its path goes on the child's command line, where
    every local user could read the JSON (tenant key hashes, until setproctitle overwrites it)."""
    path = runtime_dir / f"{name}.spec.json"
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(spec_json)
    return str(path)


def frontend_spec(config: ServeConfig, runtime_dir: Path, workers: list[WorkerSpec],
                  admin_token_sha256: str = "") -> FrontendSpec:  # fmt: skip
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
        autoscale=config.autoscale,
        tenant_metrics=config.tenant_metrics,
        metrics_token_sha256=config.metrics_token_sha256,
        listening_path=str(runtime_dir / "frontend.listening"),
        metrics_socket=str(runtime_dir / METRICS_SOCKET_FILE),
        control_address=f"ipc://{runtime_dir}/{FRONTEND_SOCKET_FILE}",
        disagg_min_prompt_tokens=config.disagg_min_prompt_tokens,
        prefix_routing_weight=config.prefix_routing_weight,
        kv_events_endpoint=config.kv_events_endpoint if config.enable_kv_cache_events else "",
        kv_events_replay_endpoint=config.kv_events_replay_endpoint,
        kv_events_topic=config.kv_events_topic,
        daemon_control_address=f"ipc://{runtime_dir}/{DAEMON_SOCKET_FILE}",
        admin_token_sha256=admin_token_sha256,
        admin_token_path=str(Path(config.state_dir) / ADMIN_TOKEN_FILE) if admin_token_sha256 else "",
    )


def gateway_spec(config: ServeConfig, runtime_dir: Path) -> GatewaySpec:
    return GatewaySpec(
        grpc_address=config.local_address(config.grpc_port),
        http_port=config.http_port,
        host=config.host,
        shutdown_timeout_s=5.0,  # by the time it is stopped, the frontend has drained
        header_timeout_s=config.http_header_timeout,
        max_connections=config.http_max_connections,
        log_level=config.log_level,
        listening_path=str(runtime_dir / "gateway.listening"),
        metrics_socket=str(runtime_dir / METRICS_SOCKET_FILE),
        metrics_token_sha256=config.metrics_token_sha256,
        metrics_require_token=config.metrics_need_token,
    )
