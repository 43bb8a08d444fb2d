"""Serving state of the frontend: in-flight requests, draining, and the health status it implies."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2

from frontend.errors import RequestError
from frontend.scheduler_link import SchedulerLink

SERVICE_NAMES = ("", "tokend.v1.Generation")


class Lifecycle:
    def __init__(self, health_servicer: health.aio.HealthServicer, link: SchedulerLink):
        self._health = health_servicer
        self._link = link
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        """Counts a new Generate call in; UNAVAILABLE once draining."""
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "server is draining; retry on another instance")
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    @property
    def is_serving(self) -> bool:
        return not self.draining and all(s.is_ready for s in self._link.schedulers)

    def schedule_health_refresh(self) -> None:
        asyncio.get_running_loop().create_task(self.refresh_health())

    async def refresh_health(self) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if self.is_serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in SERVICE_NAMES:
            await self._health.set(service, status)

    async def begin_drain(self) -> None:
        self.draining = True
        await self.refresh_health()

    async def wait_idle(self, timeout: float | None) -> bool:
        """True if every in-flight request finished within the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
