"""What admission tells a refused request: when to retry, per class; and that waiting requests of a model whose
last live scheduler stopped fail at once (the admission controller with real scheduler states)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from frontend.admission import AdmissionController, Shed
from frontend.errors import RequestError
from frontend.metrics import FrontendMetrics
from frontend.scheduler_link import SchedulerLink
from frontend.spec import AdmissionSpec, FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import LoadReport, SchedulerReady

MODEL = "llama"


def _link(projected_ttft: float = 0.0, longest_step_ms: float = 0.0) -> SchedulerLink:
    """One ready scheduler with a single slot, already taken."""
    address = SchedulerAddress(f"{MODEL}/0", MODEL, "0", "ipc:///nonexistent/0")
    spec = FrontendSpec(grpc_port=0, metrics_port=None, output_address="ipc:///nonexistent/out",
                        schedulers=[address], default_model=MODEL, secret_path="/nonexistent")  # fmt: skip
    link = SchedulerLink(spec, log=None, on_change=lambda: None)
    (state,) = link.schedulers
    state.ready = SchedulerReady(address.worker_id, "1", 1, MODEL, "/m", "0", 2048, 256, 1000, 16, 1, b"")
    state.load = LoadReport(address.worker_id, "1", 1, 0, 0, 0.1, 1000, 100, 0, 0, 0, projected_ttft, 10.0, 0.0,
                            longest_recent_step_ms=longest_step_ms)  # fmt: skip
    state.requests.add("running")
    return link


def _shed_hint(link: SchedulerLink, spec: AdmissionSpec, priority: Priority, dispatched_ago: list[float]) -> Shed:
    """Queues max_queued_requests interactive requests, then one more of `priority`: the Shed it gets."""

    async def scenario() -> Shed:
        controller = AdmissionController(link, spec, FrontendMetrics(), tenants=[])
        now = time.monotonic()
        # The pool's recent dispatches, which give its drain rate (none: no rate known yet).
        controller._pool(MODEL).dispatches.extend(now - ago for ago in dispatched_ago)
        waiting = [
            asyncio.create_task(controller.admit(MODEL, None, Priority.INTERACTIVE, 10))
            for _ in range(spec.max_queued_requests)
        ]
        try:
            with pytest.raises(Shed) as shed:
                await asyncio.wait_for(controller.admit(MODEL, None, priority, 10), 5)
            return shed.value
        finally:
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            controller.close()

    try:
        return asyncio.run(scenario())
    finally:
        link.close()


def test_an_interactive_request_refused_for_a_full_queue_is_told_to_retry_once_the_queue_drains():
    spec = AdmissionSpec(interactive_ttft_target=10, max_queued_requests=2, batch_max_queue_wait=60)
    # Two dispatches 2 s apart: 0.5 a second. Two requests ahead of a retry: 4 s, plus the 0.5 s projected.
    shed = _shed_hint(_link(projected_ttft=0.5), spec, Priority.INTERACTIVE, dispatched_ago=[4.0, 2.0, 0.0])
    assert shed.reason == "queue_full" and shed.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert shed.retry_after_s == pytest.approx(4.5, abs=0.1) and "retry in 5 s" in shed.message
    # No drain rate known yet: its class's TTFT target.
    assert _shed_hint(_link(), AdmissionSpec(max_queued_requests=2), Priority.INTERACTIVE, []).retry_after_s == 2.0
    # Never under a second, never later than batch work is told.
    tiny = AdmissionSpec(interactive_ttft_target=0.1, max_queued_requests=2)
    assert _shed_hint(_link(), tiny, Priority.INTERACTIVE, []).retry_after_s == 1.0
    short_batch_wait = AdmissionSpec(interactive_ttft_target=10, max_queued_requests=2, batch_max_queue_wait=3)
    assert _shed_hint(_link(), short_batch_wait, Priority.INTERACTIVE, []).retry_after_s == 3.0


def test_a_batch_request_refused_for_a_full_queue_keeps_the_longer_hint():
    spec = AdmissionSpec(interactive_ttft_target=10, max_queued_requests=2, batch_max_queue_wait=60)
    shed = _shed_hint(_link(projected_ttft=0.5), spec, Priority.BATCH, dispatched_ago=[4.0, 2.0, 0.0])
    assert shed.reason == "queue_full" and shed.retry_after_s == 60


def test_waiting_requests_fail_unavailable_once_their_models_last_live_scheduler_stops():
    link = _link()

    async def scenario() -> list[BaseException]:
        controller = AdmissionController(link, AdmissionSpec(), FrontendMetrics(), tenants=[])
        waiting = [asyncio.create_task(controller.admit(MODEL, None, p, 10)) for p in Priority]
        await asyncio.sleep(0.05)
        assert not any(task.done() for task in waiting)
        link.schedulers[0].unresponsive = True  # what the link's liveness watch sets, and then it pumps
        controller.pump()
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        controller.close()
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        link.close()
    assert all(isinstance(r, RequestError) and r.code == grpc.StatusCode.UNAVAILABLE for r in results)
    assert all(not isinstance(r, Shed) and "no live scheduler" in r.message for r in results)


def test_a_scheduler_is_given_a_few_of_its_longest_recent_steps_before_it_counts_as_stuck():
    link = _link(longest_step_ms=3000)
    try:
        assert link.liveness_threshold(link.schedulers[0]) == pytest.approx(6.0)
        link.schedulers[0].load = None
        assert link.liveness_threshold(link.schedulers[0]) == 2.0  # the configured liveness_timeout_s
    finally:
        link.close()
