"""WorkerSpec: everything a scheduler process needs to start, passed by the daemon as JSON on its command line."""

from __future__ import annotations

import msgspec

from common.lanes import KVLoadFailure, KVTransport, Role
from gpu_runtime.engine_config import EngineConfig


class WorkerSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    worker_id: str  # "<model>/<group>", unique in the daemon
    group: str  # the GPU group, e.g. "0"; "cpu" on machines without one
    input_address: str  # ipc:// the scheduler binds; the frontend pushes requests here
    output_address: str  # ipc:// the frontend binds; the scheduler pushes outputs here
    heartbeat_path: str  # touched by the loop while it makes progress; the daemon's watchdog reads it
    # The daemon's per-boot secret file (gpu_runtime.ipc.peer_auth): proves our readies, checks hellos. The path,
    # never the secret: the command line this spec travels on is visible to every user in `ps`.
    secret_path: str
    # The whole engine, validated by the daemon: its identity (model, served_model_name, device) is this worker's.
    engine: EngineConfig
    log_level: str = "info"
    cpu_threads: int = 0  # torch threads (torch.set_num_threads); 0 leaves torch's default
    cpu_cores: list[int] = []  # a pinned CPU group's cores: the process binds itself to them before torch loads
    load_report_interval_s: float = 0.2
    # The daemon sets it in this process's environment (None: the daemon's own, as for CPU schedulers), so that
    # engine.device "cuda:0" is this scheduler's own first GPU; carried here too for the logs.
    cuda_visible_devices: str | None = None
    devices: str = ""  # the group as configured ("cuda:1"), for the logs and start errors
    # Under tensor parallelism, how long a collective waits for the other ranks: the daemon's stall_timeout, so a
    # hung rank fails the step about when the watchdog would have killed the stalled scheduler anyway.
    collective_timeout_s: float = 30.0
    # Disaggregated serving: prefill (runs prompts, leases their pages to decode workers), decode (pulls them,
    # then generates) or mixed (both parts of every request).
    role: Role = Role.MIXED
    kv_address: str = ""  # ipc:// a prefill worker serves pulls on (in the daemon's private directory)
    kv_lease_seconds: float = 30.0  # a lease no decode worker pulled is released after this
    kv_load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE  # a pull that fails: recompute the prompt, or fail
    kv_transfer_transport: KVTransport = KVTransport.ZMQ  # how this worker pulls pages: zmq frames, or a nixl READ

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return msgspec.json.decode(text, type=cls)
