"""tokend.v1.Admin: drain, and the load of every scheduler."""

from __future__ import annotations

import time

import grpc

from frontend.lifecycle import Lifecycle
from frontend.scheduler_link import SchedulerLink
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, link: SchedulerLink, lifecycle: Lifecycle):
        self._link = link
        self._lifecycle = lifecycle

    async def Drain(self, request: pb.DrainRequest, context: grpc.aio.ServicerContext) -> pb.DrainResponse:
        await self._lifecycle.begin_drain()
        if request.wait:
            await self._lifecycle.wait_idle(timeout=None)
        return pb.DrainResponse(in_flight=self._lifecycle.in_flight)

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext) -> pb.GetLoadResponse:
        now = time.monotonic()
        loads = []
        for state in self._link.schedulers:
            report = state.load
            loads.append(
                pb.SchedulerLoad(
                    model=state.address.model_name,
                    group=state.address.group,
                    ready=state.is_ready,
                    num_running=report.num_running if report else 0,
                    num_waiting=report.num_waiting if report else 0,
                    kv_cache_usage=report.kv_cache_usage if report else 0.0,
                    projected_ttft_seconds=report.projected_ttft_seconds if report else 0.0,
                    report_age_seconds=now - state.load_received_at if report else 0.0,
                    pid=state.ready.pid if state.ready else 0,
                )
            )
        return pb.GetLoadResponse(
            schedulers=loads, draining=self._lifecycle.draining, in_flight=self._lifecycle.in_flight
        )
