"""A frontend's SchedulerLink over schedulers that never run: each made ready, with a first load report, so that
routing, admission and health can be tested on real scheduler states without processes."""

from __future__ import annotations

import structlog

from common.lanes import Role
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.messages import LoadReport, SchedulerReady

MODEL = "llama"


def ready_link(groups: int, roles: list[Role] | None = None) -> SchedulerLink:
    """`groups` ready schedulers of MODEL, idle, each of its role in `roles` (mixed by default); close() it after
    use (its ZeroMQ context)."""
    addresses = [SchedulerAddress(f"{MODEL}/{g}", MODEL, str(g), f"ipc:///nonexistent/{g}") for g in range(groups)]
    spec = FrontendSpec(grpc_port=0, metrics_port=None, output_address="ipc:///nonexistent/out",
                        schedulers=addresses, default_model=MODEL, secret_path="/nonexistent/secret")  # fmt: skip
    link = SchedulerLink(spec, log=structlog.get_logger(), on_change=lambda: None)
    for state, role in zip(link.schedulers, roles or [Role.MIXED] * groups, strict=True):
        state.role = role
        kv_address = prefill_kv_address(state.address.group) if role == Role.PREFILL else ""
        state.ready = SchedulerReady(state.address.worker_id, "1", 1, MODEL, "/m", state.address.group,
                                     2048, 256, 1000, 16, max_num_seqs=8, proof=b"", role=role,
                                     kv_address=kv_address)  # fmt: skip
        report_load(state, running=0, projected_ttft=0.0)
    return link


def prefill_kv_address(group: str) -> str:
    """Where the prefill worker of `group` says (in its ready) it serves KV pulls."""
    return f"ipc:///nonexistent/kv-{group}"


def report_load(state: SchedulerState, running: int, projected_ttft: float) -> None:
    """What the scheduler's load report would say: `running` requests, the first token of a new one in
    `projected_ttft` seconds."""
    state.load = LoadReport(state.address.worker_id, "1", running, 0, 0, 0.1, 1000, 100, 0, 0, 0,
                            projected_ttft_seconds=projected_ttft, mean_step_ms=10.0, sent_at=0.0)  # fmt: skip
