"""tokend.v1.Admin: drain, the load of every scheduler, usage, and rollouts (sent on to the daemon)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from pathlib import Path

import grpc

from frontend.autoscaler import Autoscaler
from frontend.control_link import ControlLink, DaemonUnreachable
from frontend.control_messages import RolloutCommand, RolloutStatus
from frontend.lifecycle import Lifecycle
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.usage_ledger import connect, summarize
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, link: SchedulerLink, lifecycle: Lifecycle, ledger_path: Path):
        self._link = link
        self._lifecycle = lifecycle
        self._ledger_path = ledger_path
        self.control: ControlLink | None = None  # None: no daemon (a frontend run alone) to roll out with
        self.autoscaler: Autoscaler | None = None  # None: autoscaling is off

    async def GetUsage(self, request: pb.GetUsageRequest, context: grpc.aio.ServicerContext) -> pb.GetUsageResponse:
        def read() -> dict[str, dict[str, int]]:
            with contextlib.closing(connect(self._ledger_path, read_only=True)) as connection:
                return summarize(connection, request.since_unix)

        totals = await asyncio.to_thread(read)
        return pb.GetUsageResponse(tenants={name: pb.TenantUsage(**usage) for name, usage in totals.items()})

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        await self._lifecycle.begin_drain()
        if request.wait:
            await self._lifecycle.wait_idle(timeout=None)
        return pb.DrainResponse(in_flight=self._lifecycle.in_flight)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:
        decisions = self.autoscaler.latest.items() if self.autoscaler is not None else ()
        return pb.GetLoadResponse(
            schedulers=[self._load_of(state) for state in self._link.schedulers],
            draining=self._lifecycle.draining,
            in_flight=self._lifecycle.in_flight,
            autoscale=[
                pb.AutoscaleDecision(
                    model=model,
                    role=role,
                    desired_replicas=verdict.decision.desired,
                    direction=verdict.decision.direction,
                    reason=verdict.decision.reason,
                    effective_ttft_seconds=verdict.snapshot.effective_ttft_s,
                    queue_depth=verdict.snapshot.queue_depth,
                    desired_standby=verdict.standby,
                    peak_requests_per_second=verdict.peak_rps,
                )  # fmt: skip
                for (model, role), verdict in decisions
            ],
        )

    async def Rollout(self, request: pb.RolloutRequest, context: grpc.aio.ServicerContext) -> pb.RolloutResponse:
        if self.control is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this frontend runs without a daemon to roll out")
        command = RolloutCommand(uuid.uuid4().hex, request.model, request.path, request.strategy,
                                 request.canary_percent, request.rollback)  # fmt: skip
        try:
            result = await self.control.rollout(command)
        except DaemonUnreachable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        if result.error:
            await context.abort(getattr(grpc.StatusCode, result.code, grpc.StatusCode.INVALID_ARGUMENT), result.error)
        return pb.RolloutResponse(rollout=self._status(result.rollout))

    async def GetRollout(
        self, request: pb.GetRolloutRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetRolloutResponse:
        statuses = self._link.worker_set.rollouts
        if request.model and request.model not in statuses:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model: {request.model!r} has no rollout here; "
                                f"known: {sorted(statuses)}")  # fmt: skip
        chosen = [statuses[request.model]] if request.model else list(statuses.values())
        return pb.GetRolloutResponse(rollouts=[self._status(status) for status in chosen])

    def _status(self, status: RolloutStatus) -> pb.RolloutStatus:
        workers = [self._load_of(s) for s in self._link.schedulers if s.address.model_name == status.model_name]
        return pb.RolloutStatus(
            model=status.model_name,
            phase=status.phase,
            path=status.path,
            previous_path=status.previous_path,
            strategy=str(status.strategy),
            canary_percent=status.canary_percent,
            epoch=status.epoch,
            error=status.error,
            events=status.events,
            workers=workers,
        )

    def _load_of(self, state: SchedulerState) -> pb.SchedulerLoad:
        report = state.load
        return pb.SchedulerLoad(
            model=state.address.model_name,
            group=state.address.group,
            ready=state.takes_new_requests,  # serving, ready, and its reports arrive: it takes new requests
            num_running=report.num_running if report else 0,
            num_waiting=report.num_waiting if report else 0,
            kv_cache_usage=report.kv_cache_usage if report else 0.0,
            projected_ttft_seconds=report.projected_ttft_seconds if report else 0.0,
            report_age_seconds=time.monotonic() - state.load_received_at if report else 0.0,
            pid=state.ready.pid if state.ready else 0,
            worker_id=state.address.worker_id,
            state=str(state.worker_state),
            generation=state.generation,
            role=str(state.role),
            epoch=state.epoch,
            num_used_pages=report.num_used_pages if report else 0,
            num_pages=report.num_pages if report else 0,
            kv_leases_held=report.kv_leases_held if report else 0,
        )
