"""The frontend's side of the ZeroMQ link: one PUSH socket per scheduler, one PULL socket for all outputs.

A scheduler that dies is noticed at once through its socket's disconnect event: its in-flight requests get
SchedulerLost, it is unready until it says SchedulerReady again, and its socket is rebuilt so that no
request queued for the dead process reaches its successor.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from frontend.spec import FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import (
    AbortRequests,
    AddRequest,
    FrontendHello,
    LoadReport,
    SchedulerReady,
    StepOutputs,
    frontend_codec,
    scheduler_codec,
)


class SchedulerLost:
    """Put in a request's queue when its scheduler died or the frontend gave up on it."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass(eq=False)
class SchedulerState:
    address: SchedulerAddress
    socket: zmq.asyncio.Socket | None = None
    ready: SchedulerReady | None = None  # None while down or starting
    load: LoadReport | None = None
    load_received_at: float = 0.0
    requests: set[str] = field(default_factory=set)
    reserved: int = 0  # slots admission gave to requests on their way to submit()
    monitor_task: asyncio.Task | None = None

    @property
    def is_ready(self) -> bool:
        return self.ready is not None

    @property
    def projected_ttft_seconds(self) -> float:
        return self.load.projected_ttft_seconds if self.load is not None else 0.0


@dataclass(eq=False)
class RequestStream:
    request_id: str
    scheduler: SchedulerState
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestDelta | SchedulerLost
    tenant: str | None = None  # who sent it (None while authentication is off)
    priority: Priority = Priority.INTERACTIVE
    cost: int = 0  # prompt + max_tokens: what admission charged its tenant at dispatch
    finished: bool = False  # the scheduler sent its final delta
    lost: bool = False  # the scheduler died (or the frontend gave up on it): no final delta will come


class SchedulerLink:
    def __init__(self, spec: FrontendSpec, log, on_change: Callable[[], None]):
        self.frontend_id = uuid.uuid4().hex
        self.schedulers = [SchedulerState(address) for address in spec.schedulers]
        self._spec = spec
        self._log = log
        self._on_change = on_change  # called whenever a scheduler becomes ready or is lost
        self._context = zmq.asyncio.Context()
        self._streams: dict[str, RequestStream] = {}
        self._to_scheduler = scheduler_codec()
        self._from_scheduler = frontend_codec()
        self._outputs = self._context.socket(zmq.PULL)
        self._receiver: asyncio.Task | None = None
        self.on_load: Callable[[SchedulerState, LoadReport], None] = lambda state, report: None
        self.on_lost: Callable[[SchedulerState], None] = lambda state: None

    async def start(self) -> None:
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.bind(self._spec.output_address)
        for state in self.schedulers:
            self._connect(state)
        self._receiver = asyncio.create_task(self._receive_forever(), name="scheduler-outputs")

    def close(self) -> None:
        tasks = [self._receiver] + [s.monitor_task for s in self.schedulers]
        for task in tasks:
            if task is not None:
                task.cancel()
        self._context.destroy(linger=0)

    # -- requests -------------------------------------------------------------------------------------------

    def ready_schedulers(self, model_name: str) -> list[SchedulerState]:
        return [s for s in self.schedulers if s.address.model_name == model_name and s.is_ready]

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self._streams

    def submit(
        self, scheduler: SchedulerState, message: AddRequest, tenant: str | None = None, cost: int = 0
    ) -> RequestStream:
        stream = RequestStream(message.request_id, scheduler, tenant=tenant, priority=message.priority, cost=cost)
        scheduler.reserved = max(0, scheduler.reserved - 1)
        self._streams[message.request_id] = stream
        scheduler.requests.add(message.request_id)
        self._send(scheduler, message)
        return stream

    def owner(self, request_id: str) -> str | None:
        stream = self._streams.get(request_id)
        return stream.tenant if stream else None

    def abort(self, request_id: str) -> bool:
        """Asks the request's scheduler to drop it; its final counts still arrive on its stream."""
        stream = self._streams.get(request_id)
        if stream is None or not stream.scheduler.is_ready:
            return False
        self._send(stream.scheduler, AbortRequests([request_id]))
        return True

    def forget(self, stream: RequestStream) -> None:
        """The handler is done with the stream (deltas that still arrive for it are dropped)."""
        self._streams.pop(stream.request_id, None)
        stream.scheduler.requests.discard(stream.request_id)

    def fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.lost = True
            stream.queue.put_nowait(SchedulerLost(reason))

    def _send(self, scheduler: SchedulerState, message: msgspec.Struct) -> None:
        try:
            scheduler.socket.send(self._to_scheduler.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self._log.warning("scheduler_queue_full", worker=scheduler.address.worker_id)
            self._lose(scheduler, "scheduler is not taking requests")

    # -- connection -----------------------------------------------------------------------------------------

    def _connect(self, state: SchedulerState) -> None:
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 100_000)
        state.socket = socket
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        socket.connect(state.address.input_address)
        state.monitor_task = asyncio.create_task(self._watch(state, socket, monitor), name="scheduler-monitor")
        # Queued until the scheduler binds; it answers with SchedulerReady.
        socket.send(self._to_scheduler.encode(FrontendHello(self.frontend_id)), zmq.NOBLOCK)

    async def _watch(self, state: SchedulerState, socket: zmq.asyncio.Socket, monitor) -> None:
        try:
            while True:
                event = await recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    break
        except asyncio.CancelledError:
            monitor.close(linger=0)
            raise
        socket.disable_monitor()
        monitor.close(linger=0)
        self._log.warning("scheduler_lost", worker=state.address.worker_id)
        self._lose(state, f"the scheduler of model {state.address.model_name!r} stopped; retry")
        socket.close(linger=0)  # drops whatever was queued for the dead process
        self._connect(state)

    def _lose(self, state: SchedulerState, reason: str) -> None:
        was_ready = state.is_ready
        state.ready = None
        state.load = None
        for request_id in list(state.requests):
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.lost = True
                stream.queue.put_nowait(SchedulerLost(reason))
        state.requests.clear()
        self.on_lost(state)
        if was_ready:
            self._on_change()

    # -- outputs --------------------------------------------------------------------------------------------

    async def _receive_forever(self) -> None:
        while True:
            data = await self._outputs.recv()
            try:
                message = self._from_scheduler.decode(data)
            except msgspec.DecodeError as error:
                self._log.warning("dropped_bad_message", bytes=len(data), error=str(error)[:200])
                continue
            state = self._scheduler(message.worker_id)
            if state is None:
                continue
            if isinstance(message, StepOutputs):
                self._dispatch(state, message)
            elif isinstance(message, LoadReport):
                if state.ready is not None and message.incarnation == state.ready.incarnation:
                    state.load, state.load_received_at = message, time.monotonic()
                    self.on_load(state, message)
            elif isinstance(message, SchedulerReady):
                self._on_ready(state, message)

    def _on_ready(self, state: SchedulerState, message: SchedulerReady) -> None:
        if state.ready is not None and state.ready.incarnation != message.incarnation:
            self._lose(state, f"the scheduler of model {state.address.model_name!r} restarted; retry")
        if state.ready is None:
            self._log.info("scheduler_ready", worker=message.worker_id, pid=message.pid)
            state.ready = message
            self._on_change()

    def _dispatch(self, state: SchedulerState, message: StepOutputs) -> None:
        orphans = []
        for delta in message.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.scheduler is not state:
                if delta.finish_reason is None:
                    orphans.append(delta.request_id)  # nobody reads it: stop computing it
                continue
            stream.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                stream.finished = True
        if orphans and state.is_ready:
            self._send(state, AbortRequests(orphans))

    def _scheduler(self, worker_id: str) -> SchedulerState | None:
        return next((s for s in self.schedulers if s.address.worker_id == worker_id), None)
