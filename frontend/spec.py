"""FrontendSpec: everything the frontend process needs, passed by the daemon as JSON on its command line."""

from __future__ import annotations

import msgspec


class SchedulerAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str
    model_name: str
    group: str
    input_address: str  # ipc:// the scheduler binds


class FrontendSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    grpc_port: int
    metrics_port: int | None  # None: no /metrics endpoint
    output_address: str  # ipc:// this process binds; every scheduler pushes its outputs here
    schedulers: list[SchedulerAddress]
    default_model: str
    drain_timeout_s: float = 30.0
    max_request_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> FrontendSpec:
        return msgspec.json.decode(text, type=cls)
