"""Serving state of the frontend: in-flight requests, draining, and the health status it implies.

Health has one service per served model (its name), SERVING while some scheduler of the model takes new requests
or a rollout is between workers (requests wait for the new one), and the whole server's ("" and
tokend.v1.Generation), SERVING while every scheduler takes new requests (but those a rollout is starting or
retiring, and standbys) and every model is; all NOT_SERVING once draining.
"liveness" is SERVING for as long as the frontend answers at all: a liveness probe (Kubernetes) must not restart a
daemon that is only reloading a crashed scheduler or draining, which the daemon handles itself. So are the services
that answer whatever the schedulers do, draining included: tokend.v1.Admin (Drain and GetLoad are what an operator
uses then), health itself and reflection; every service the server serves has a health status.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2

from common.lanes import WorkerState
from frontend.errors import RequestError
from frontend.grpc_reflection import SERVICE_NAMES as REFLECTION_SERVICE_NAMES
from frontend.scheduler_link import SchedulerLink, SchedulerState

SERVICE_NAMES = ("", "tokend.v1.Generation")
LIVENESS_SERVICE = "liveness"
ALWAYS_SERVING = (LIVENESS_SERVICE, "tokend.v1.Admin", "grpc.health.v1.Health", *REFLECTION_SERVICE_NAMES)


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
        """Every worker that should be serving takes new requests, and every model can take requests. Live is not
        enough: a worker answers ready a moment before the daemon counts it serving, and a request in that moment
        passes it over (a prefill worker's prompt would be computed on the decode worker). The daemon's worker set
        is the one readiness source (frontend.worker_view)."""
        if self.draining:
            return False
        models = dict.fromkeys(s.address.model_name for s in self._link.schedulers)
        return all(s.takes_new_requests for s in self._link.schedulers if self._counts(s)) and all(
            self.model_is_serving(model) for model in models
        )

    def model_is_serving(self, model_name: str) -> bool:
        """Some worker of the model takes new requests, or a rollout is between workers (requests wait for it)."""
        if self.draining:
            return False
        return bool(self._link.ready_schedulers(model_name)) or self._link.expects_capacity(model_name)

    def _counts(self, state: SchedulerState) -> bool:
        """Whether a worker's being down makes the server not serving: a draining one is on its way out, and one
        a rollout is starting is not serving yet; a crashed one (restarting) counts, as before rollouts."""
        if state.worker_state in (WorkerState.DRAINING, WorkerState.STANDBY, WorkerState.RETIRED):
            return False
        return not (state.worker_state == WorkerState.STARTING and state.epoch > 0)

    def schedule_health_refresh(self) -> None:
        asyncio.get_running_loop().create_task(self.refresh_health())

    async def refresh_health(self) -> None:
        for service in ALWAYS_SERVING:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        for service in SERVICE_NAMES:
            await self._health.set(service, _status(self.is_serving))
        for model_name in dict.fromkeys(s.address.model_name for s in self._link.schedulers):
            await self._health.set(model_name, _status(self.model_is_serving(model_name)))

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


def _status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
