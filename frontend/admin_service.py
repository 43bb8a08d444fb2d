"""tokend.v1.Admin: drain, and the load of every scheduler."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc

from frontend.lifecycle import Lifecycle
from frontend.scheduler_link import SchedulerLink
from frontend.usage_ledger import connect, summarize
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


class AdminService(pb_grpc.AdminServicer):
    def __init__(self, link: SchedulerLink, lifecycle: Lifecycle, ledger_path: Path):
        self._link = link
        self._lifecycle = lifecycle
        self._ledger_path = ledger_path

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
        now = time.monotonic()
        loads = []
        for state in self._link.schedulers:
            report = state.load
            loads.append(
                pb.SchedulerLoad(
                    model=state.address.model_name,
                    group=state.address.group,
                    ready=state.is_live,  # ready, and its reports arrive: it takes new requests
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
