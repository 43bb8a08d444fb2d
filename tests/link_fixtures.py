"""A frontend's SchedulerLink over schedulers that never run: each made ready, with a first load report, so that
routing, admission and health can be tested on real scheduler states without processes."""

from __future__ import annotations

from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.messages import LoadReport, SchedulerReady

MODEL = "llama"


def ready_link(groups: int) -> SchedulerLink:
    """`groups` ready schedulers of MODEL, idle; close() it after use (its ZeroMQ context)."""
    addresses = [SchedulerAddress(f"{MODEL}/{g}", MODEL, str(g), f"ipc:///nonexistent/{g}") for g in range(groups)]
    spec = FrontendSpec(grpc_port=0, metrics_port=None, output_address="ipc:///nonexistent/out",
                        schedulers=addresses, default_model=MODEL, secret_path="/nonexistent/secret")  # fmt: skip
    link = SchedulerLink(spec, log=None, on_change=lambda: None)
    for state in link.schedulers:
        state.ready = SchedulerReady(state.address.worker_id, "1", 1, MODEL, "/m", state.address.group,
                                     2048, 256, 1000, 16, max_num_seqs=8, proof=b"")  # fmt: skip
        report_load(state, running=0, projected_ttft=0.0)
    return link


def report_load(state: SchedulerState, running: int, projected_ttft: float) -> None:
    """What the scheduler's load report would say: `running` requests, the first token of a new one in
    `projected_ttft` seconds."""
    state.load = LoadReport(state.address.worker_id, "1", running, 0, 0, 0.1, 1000, 100, 0, 0, 0,
                            projected_ttft_seconds=projected_ttft, mean_step_ms=10.0, sent_at=0.0)  # fmt: skip
