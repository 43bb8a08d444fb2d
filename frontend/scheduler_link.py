"""The frontend's side of the ZeroMQ link: one PUSH socket per scheduler, one PULL socket for all outputs.

A scheduler that dies is noticed at once through its socket's disconnect event: its in-flight requests get
SchedulerLost, it is unready until it says SchedulerReady again, and its socket is rebuilt so that no
request queued for the dead process reaches its successor. A scheduler that is alive but stuck (its load
reports stop) is noticed within the liveness timeout: it takes no new requests until it reports again, and
the requests it runs wait for it (the daemon kills it after stall_timeout, and then they fail as above).

Nothing that arrives on the output socket stops its receiver: undecodable bytes are dropped, a SchedulerReady
without a genuine proof is dropped as forged, outputs and load reports count only with the incarnation of a
genuine ready, and a failure while handling a message costs that message only.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from frontend.control_messages import WorkerSet, WorkerState
from frontend.spec import FrontendSpec, SchedulerAddress
from frontend.worker_set_view import WorkerSetView
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import (
    MAX_MESSAGE_BYTES,
    AbortRequests,
    AddRequest,
    DrainWorker,
    FrontendHello,
    LoadReport,
    RequestDelta,
    SchedulerReady,
    StepOutputs,
    ToFrontend,
    frontend_codec,
    scheduler_codec,
)
from gpu_runtime.ipc.peer_auth import PeerAuth, read_secret

# Reports come from the scheduler loop between engine steps, so one long step delays the next report by that
# long: a scheduler is only called unresponsive after a silence longer than the liveness timeout, and longer
# than this many of its recent longest steps and of its mean ones (a prefill step may take far longer than the
# decode steps that make up most of the mean).
_LONGEST_STEPS_OF_SLACK = 2
_MEAN_STEPS_OF_SLACK = 4


class SchedulerLost:
    """Put in a request's queue when its scheduler died or the frontend gave up on it."""

    def __init__(self, reason: str):
        self.reason = reason


_MIN_STEP_S = 0.001  # a step's least cost in the routing key, for a worker with no step time reported yet


@dataclass(eq=False)
class SchedulerState:
    address: SchedulerAddress
    # Its place in the daemon's worker set (frontend.control_messages): only SERVING workers get new requests.
    worker_state: WorkerState = WorkerState.SERVING
    epoch: int = 0
    warmup_seconds: float = 0.0
    standby: bool = False  # a pre-warmed standby (or one starting): not routed until promoted
    socket: zmq.asyncio.Socket | None = None
    ready: SchedulerReady | None = None  # None while down or starting
    load: LoadReport | None = None
    load_received_at: float = 0.0
    heard_at: float = 0.0  # monotonic time of its latest ready, outputs or load report
    unresponsive: bool = False  # ready, but silent for longer than the liveness threshold
    requests: set[str] = field(default_factory=set)
    reserved: int = 0  # slots admission gave to requests on their way to submit()
    monitor_task: asyncio.Task | None = None
    last_role: str = "mixed"
    # Outputs that came before this frontend had the scheduler's proven ready: the final counts of requests of a
    # frontend that died, sent before the scheduler noticed. Replayed once a genuine ready names their sender.
    unproven: collections.deque[StepOutputs] = field(default_factory=lambda: collections.deque(maxlen=256))

    @property
    def is_ready(self) -> bool:
        return self.ready is not None

    @property
    def is_live(self) -> bool:
        """Ready and making progress."""
        return self.ready is not None and not self.unresponsive

    @property
    def takes_new_requests(self) -> bool:
        return self.is_live and self.worker_state == WorkerState.SERVING

    @property
    def generation(self) -> str:
        return self.ready.generation if self.ready is not None else ""

    @property
    def role(self) -> str:
        """ "prefill", "decode" or "mixed" (as its SchedulerReady said)."""
        return self.ready.role if self.ready is not None else "mixed"

    @property
    def projected_ttft_seconds(self) -> float:
        return self.load.projected_ttft_seconds if self.load is not None else 0.0

    @property
    def routing_key(self) -> tuple[float, int]:
        """The sooner projected first token, then fewer requests. The projection is as old as the latest load
        report, so each request sent here since counts as one more prompt ahead of the next: otherwise a burst
        would all go to whichever worker looked fastest before it began. A first token takes at least one step,
        so the projection counts one more (its mean step, at least _MIN_STEP_S): an idle worker projecting 0 s, or
        one that has sent no load report yet, would otherwise stay at 0 s however many requests went to it since."""
        outstanding = len(self.requests) + self.reserved
        reported = self.load.num_running + self.load.num_waiting if self.load is not None else 0
        step_s = max(self.load.mean_step_ms / 1e3 if self.load is not None else 0.0, _MIN_STEP_S)
        return (self.projected_ttft_seconds + step_s) * (1 + max(0, outstanding - reported)), outstanding


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
    # While a prefill worker computes its prompt: the decode worker admission chose, its slot held until then.
    decode_on: SchedulerState | None = None


class SchedulerLink:
    def __init__(self, spec: FrontendSpec, log, on_change: Callable[[], None]):
        self.frontend_id = uuid.uuid4().hex
        self.schedulers = [SchedulerState(address) for address in spec.schedulers]
        self.worker_set = WorkerSetView()  # the daemon's latest WorkerSet, as routing reads it
        self._spec = spec
        self._log = log
        self._on_change = on_change  # called whenever a scheduler becomes ready or live, or stops being either
        self._auth: PeerAuth | None = None  # from the secret file, read in start()
        self._context = zmq.asyncio.Context()
        self._streams: dict[str, RequestStream] = {}
        self._to_scheduler = scheduler_codec()
        self._from_scheduler = frontend_codec()
        self._outputs = self._context.socket(zmq.PULL)
        self._tasks: list[asyncio.Task] = []
        self._failed_kinds: set[str] = set()  # exception types already logged with a traceback
        self.on_load: Callable[[SchedulerState, LoadReport], None] = lambda state, report: None
        self.on_lost: Callable[[SchedulerState], None] = lambda state: None
        # Every final delta whose request this link does not know: a request of a previous frontend, whose
        # scheduler aborted it when this frontend said hello (or that ended while no frontend was there), or
        # one this frontend already forgot. Its counts are the scheduler's authoritative ones; the same request
        # id may have been closed already (the callback ignores what it closed itself).
        self.on_orphan_finished: Callable[[SchedulerState, RequestDelta], None] = lambda state, delta: None

    async def start(self) -> None:
        """Reads the daemon's secret (OSError/ValueError if it cannot), binds the outputs, greets every scheduler."""
        self._auth = PeerAuth(read_secret(self._spec.secret_path))
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._outputs.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # zmq drops a sender that goes beyond it
        self._outputs.bind(self._spec.output_address)
        for state in self.schedulers:
            self._connect(state)
        self._tasks.append(asyncio.create_task(self._receive_forever(), name="scheduler-outputs"))
        self._tasks.append(asyncio.create_task(self._watch_liveness(), name="scheduler-liveness"))
        self._tasks[0].add_done_callback(self._receiver_stopped)

    def close(self) -> None:
        tasks = self._tasks + [s.monitor_task for s in self.schedulers]
        for task in tasks:
            if task is not None:
                task.cancel()
        self._context.destroy(linger=0)

    # -- requests -------------------------------------------------------------------------------------------

    def ready_schedulers(self, model_name: str, prefill: bool = False) -> list[SchedulerState]:
        """The model's schedulers that may take a new request: serving, ready, and live; those that generate
        (decode and mixed workers), or with `prefill` its prefill workers."""
        return [
            s for s in self.schedulers
            if s.address.model_name == model_name and s.takes_new_requests and (s.role == "prefill") == prefill
        ]  # fmt: skip

    def routed_schedulers(self, model_name: str, draw: float) -> list[SchedulerState]:
        """The ready schedulers a new request may go to: the newest serving weights, or a canary's share (`draw`
        in [0, 1) is the request's own)."""
        return self.worker_set.route(model_name, self.ready_schedulers(model_name), draw)

    def expects_capacity(self, model_name: str) -> bool:
        """True while a rollout of the model is under way: a moment with no serving worker is planned, not lost."""
        return self.worker_set.is_rolling(model_name)

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

    def submit_prefill(
        self, prefill: SchedulerState, decode: SchedulerState, message: AddRequest, tenant: str | None, cost: int
    ) -> RequestStream:
        """Starts a disaggregated request on `prefill`, keeping the slot admission gave it on `decode`."""
        stream = RequestStream(message.request_id, prefill, tenant=tenant, priority=message.priority, cost=cost)
        stream.decode_on = decode
        self._streams[message.request_id] = stream
        prefill.requests.add(message.request_id)
        self._send(prefill, message)
        return stream

    def end_prefill(self, stream: RequestStream) -> SchedulerState | None:
        """The prefill part is over: the decode worker's held slot is given back to the count (the request takes
        it now, or never); returns that worker."""
        decode, stream.decode_on = stream.decode_on, None
        if decode is not None:
            decode.reserved = max(0, decode.reserved - 1)
        return decode

    def resubmit(self, stream: RequestStream, scheduler: SchedulerState, message: AddRequest) -> None:
        """Moves a stream whose worker retired mid-request to `scheduler`, where `message` continues it."""
        stream.scheduler.requests.discard(stream.request_id)
        stream.scheduler, stream.finished = scheduler, False
        scheduler.requests.add(stream.request_id)
        self._send(scheduler, message)

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
        self.end_prefill(stream)

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
        # First on this connection, so the scheduler takes what follows; queued until it binds; it answers with
        # SchedulerReady.
        hello = FrontendHello(self.frontend_id, self._auth.hello_proof(self.frontend_id))
        socket.send(self._to_scheduler.encode(hello), zmq.NOBLOCK)

    # -- the worker set --------------------------------------------------------------------------------------

    def apply_worker_set(self, message: WorkerSet) -> None:
        """Takes the daemon's set: new workers are connected, states and epochs updated, retired ones dropped;
        a worker newly draining is told so after every request already sent to it."""
        self.worker_set.update(message)
        known = {s.address.worker_id: s for s in self.schedulers}
        listed = {info.worker_id for info in message.workers}
        for info in message.workers:
            state = known.get(info.worker_id)
            if state is None:
                address = SchedulerAddress(info.worker_id, info.model_name, info.group, info.input_address)
                state = SchedulerState(address, info.state, info.epoch)
                self.schedulers.append(state)
                self._connect(state)
                self._log.info("worker_added", worker=info.worker_id, epoch=info.epoch, state=str(info.state))
            elif state.worker_state != info.state:
                self._log.info("worker_state", worker=info.worker_id, state=str(info.state))
            if info.state == WorkerState.DRAINING and state.worker_state != WorkerState.DRAINING:
                state.worker_state = info.state
                if state.is_ready:
                    self._send(state, DrainWorker(message.drain_timeout_s, str(message.on_drain_timeout)))
            state.worker_state, state.epoch = info.state, info.epoch
            state.warmup_seconds, state.standby, state.last_role = info.warmup_seconds, info.standby, info.role
        for state in [s for s in self.schedulers if s.address.worker_id not in listed]:
            self._retire(state)
        self._on_change()

    def _retire(self, state: SchedulerState) -> None:
        self._log.info("worker_removed", worker=state.address.worker_id)
        self._lose(state, f"the scheduler of model {state.address.model_name!r} was retired; retry")
        self.schedulers.remove(state)
        if state.monitor_task is not None:
            state.monitor_task.cancel()
        if state.socket is not None:
            state.socket.close(linger=0)

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
        if state.worker_state == WorkerState.DRAINING and not state.requests:
            self._log.info("worker_exited", worker=state.address.worker_id, detail="drained")
        else:
            self._log.warning("scheduler_lost", worker=state.address.worker_id)
        self._lose(state, f"the scheduler of model {state.address.model_name!r} stopped; retry")
        socket.close(linger=0)  # drops whatever was queued for the dead process
        self._connect(state)

    def _lose(self, state: SchedulerState, reason: str) -> None:
        was_ready = state.is_ready
        state.ready = None
        state.load = None
        state.unresponsive = False
        for request_id in list(state.requests):
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:  # a finished one has all it will get (or migrates)
                stream.lost = True
                stream.queue.put_nowait(SchedulerLost(reason))
        state.requests.clear()
        self.on_lost(state)
        if was_ready:
            self._on_change()

    # -- liveness -------------------------------------------------------------------------------------------

    def liveness_threshold(self, state: SchedulerState) -> float:
        """Seconds of silence after which a ready scheduler counts as stuck."""
        load = state.load
        if load is None:
            return self._spec.liveness_timeout_s
        steps_s = max(_LONGEST_STEPS_OF_SLACK * load.longest_recent_step_ms, _MEAN_STEPS_OF_SLACK * load.mean_step_ms)
        return max(self._spec.liveness_timeout_s, steps_s / 1000)

    async def _watch_liveness(self) -> None:
        interval = min(0.25, self._spec.liveness_timeout_s / 4)
        last_tick = clock_restart = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            if now - last_tick > 2 * interval:
                # This process itself was held up (reports may be waiting unread in the socket): silence is
                # counted from now, so that a stalled frontend never calls its schedulers stuck.
                clock_restart = now
            last_tick = now
            for state in self.schedulers:
                silent_s = now - max(state.heard_at, clock_restart)
                if state.is_live and silent_s > self.liveness_threshold(state):
                    state.unresponsive = True
                    self._log.warning("scheduler_unresponsive", worker=state.address.worker_id,
                                      seconds_since_report=round(now - state.heard_at, 2),
                                      threshold_s=round(self.liveness_threshold(state), 2))  # fmt: skip
                    self._on_change()

    def _heard_from(self, state: SchedulerState) -> None:
        state.heard_at = time.monotonic()
        if state.unresponsive:
            state.unresponsive = False
            self._log.info("scheduler_responsive", worker=state.address.worker_id)
            self._on_change()

    # -- outputs --------------------------------------------------------------------------------------------

    async def _receive_forever(self) -> None:
        while True:
            data = await self._outputs.recv()
            try:
                message = self._from_scheduler.decode(data)
            except Exception as error:  # RecursionError included (see Codec.decode)
                self._log.warning(
                    "dropped_bad_message", bytes=len(data), error_type=type(error).__name__, error=str(error)[:200]
                )
                continue
            try:
                self._handle(message)
            except Exception as error:
                kind = type(error).__name__
                # One traceback per kind of failure: a peer repeating a bad message must not flood the log.
                self._log.error("message_failed", message=type(message).__name__, error_type=kind,
                                error=str(error)[:200], exc_info=kind not in self._failed_kinds)  # fmt: skip
                self._failed_kinds.add(kind)

    def _receiver_stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled():  # then liveness calls every scheduler stuck, and health says NOT_SERVING
            self._log.error("receiver_stopped", error=repr(task.exception()))

    def _handle(self, message: ToFrontend) -> None:
        state = self._scheduler(message.worker_id)
        if state is None:
            return
        if isinstance(message, SchedulerReady):
            self._on_ready(state, message)
            return
        if state.ready is None and isinstance(message, StepOutputs):
            state.unproven.append(message)
            return
        if state.ready is None or message.incarnation != state.ready.incarnation:
            # Queued by a process that is gone or not yet ready, or sent by one that never proved itself.
            self._log.debug("dropped_stale_message", kind=type(message).__name__, worker=message.worker_id)
            return
        self._heard_from(state)
        if isinstance(message, StepOutputs):
            self._dispatch(state, message)
        elif isinstance(message, LoadReport):
            state.load, state.load_received_at = message, time.monotonic()
            self.on_load(state, message)

    def _on_ready(self, state: SchedulerState, message: SchedulerReady) -> None:
        if not self._auth.ready_is_genuine(message.worker_id, message.incarnation, message.proof):
            self._log.warning("forged_message", kind="SchedulerReady", worker=message.worker_id, pid=message.pid)
            return
        if state.ready is not None and state.ready.incarnation != message.incarnation:
            self._lose(state, f"the scheduler of model {state.address.model_name!r} restarted; retry")
        if state.ready is None:
            self._log.info("scheduler_ready", worker=message.worker_id, pid=message.pid, generation=message.generation)
            state.ready, state.last_role = message, message.role
            if state.worker_state == WorkerState.DRAINING:  # it was told before this frontend existed, or not at all
                view = self.worker_set
                self._send(state, DrainWorker(view.drain_timeout_s, view.on_drain_timeout))
            state.heard_at = time.monotonic()
            while state.unproven:
                earlier = state.unproven.popleft()
                if earlier.incarnation == message.incarnation:
                    self._dispatch(state, earlier)
            self._on_change()
        else:
            self._heard_from(state)

    def _dispatch(self, state: SchedulerState, message: StepOutputs) -> None:
        orphans, orphan_finals = [], []
        for delta in message.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.scheduler is not state:
                if delta.finish_reason is None:
                    orphans.append(delta.request_id)  # nobody reads it: stop computing it
                elif stream is None:
                    orphan_finals.append(delta)
                continue
            stream.queue.put_nowait(delta)
            if delta.finish_reason is not None:
                stream.finished = True
        if orphans and state.is_ready:
            self._send(state, AbortRequests(orphans))
        for delta in orphan_finals:  # after the known streams: a failing callback must not cost them deltas
            self._orphan_finished(state, delta)

    def _orphan_finished(self, state: SchedulerState, delta: RequestDelta) -> None:
        self._log.info("orphan_finished", request_id=delta.request_id, worker=state.address.worker_id,
                       finish_reason=str(delta.finish_reason), prompt_tokens=delta.num_prompt_tokens,
                       completion_tokens=delta.num_output_tokens)  # fmt: skip
        try:
            self.on_orphan_finished(state, delta)
        except Exception as error:
            self._log.error("orphan_callback_failed", request_id=delta.request_id, error=repr(error), exc_info=True)

    def _scheduler(self, worker_id: str) -> SchedulerState | None:
        return next((s for s in self.schedulers if s.address.worker_id == worker_id), None)
