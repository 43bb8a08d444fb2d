"""The frontend's side of the ZeroMQ link: one PUSH socket per scheduler, one PULL socket for all outputs.

The link owns the sockets, the hellos and the liveness watch; what it knows of each worker is in its WorkerView
(frontend.worker_view: state, load, slots, routing), and the requests in flight are its RequestStreams
(frontend.request_streams). What one request does across workers is its RequestSession's business.

A scheduler that dies is noticed at once through its socket's disconnect event: its in-flight requests get
SchedulerLost, it is unready until it says SchedulerReady again, and its socket is rebuilt so that no
request queued for the dead process reaches its successor. A scheduler that is alive but stuck (its load
reports stop) is noticed within the liveness timeout: it takes no new requests until it reports again, and
the requests it runs wait for it (the daemon kills it after stall_timeout, and then they fail as above).

Nothing that arrives on the output socket stops its receiver: undecodable bytes are dropped, a SchedulerReady
without a genuine proof is dropped as forged, outputs and load reports count only with the incarnation of a
genuine ready and the seal of the session its hello and that ready opened (a sequence above the last one taken:
a replayed frame is forged too), and a failure while handling a message costs that message only. What the link
sends after its hello is sealed on the same session, so a scheduler takes requests from this frontend only.
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from common.lanes import Pool, WorkerState
from frontend.control_messages import WorkerSet
from frontend.request_streams import RequestStream, RequestStreams
from frontend.spec import FrontendSpec
from frontend.worker_set_view import WorkerSetView
from frontend.worker_view import SchedulerState, WorkerView
from gpu_runtime.ipc.messages import (
    MAX_MESSAGE_BYTES,
    AbortRequests,
    AddRequest,
    DrainWorker,
    FrontendHello,
    KVEvents,
    LoadReport,
    RequestDelta,
    SchedulerReady,
    StepOutputs,
    ToFrontend,
    frontend_codec,
    scheduler_codec,
)
from gpu_runtime.ipc.peer_auth import TO_FRONTEND, PeerAuth, read_secret
from gpu_runtime.ipc.rejected_messages import FORGED, MALFORMED, RejectedMessages

_NONCE_BYTES = 16

# Reports come from the scheduler loop between engine steps, so one long step delays the next report by that
# long: a scheduler is only called unresponsive after a silence longer than the liveness timeout, and longer
# than this many of its recent longest steps and of its mean ones (a prefill step may take far longer than the
# decode steps that make up most of the mean).
# A drained worker sends its last deltas, then exits; they come on the outputs socket, which may be read after this
# side's disconnect is seen. Its streams get this long to be read before they count as lost.
_LAST_OUTPUTS_GRACE_S = 2.0
_LONGEST_STEPS_OF_SLACK = 2
_MEAN_STEPS_OF_SLACK = 4


class SchedulerLink:
    def __init__(self, spec: FrontendSpec, log, on_change: Callable[[], None]):
        self.frontend_id = uuid.uuid4().hex
        # With a daemon (a control channel), no worker is routed before the daemon's worker set says it serves.
        initial = WorkerState.STARTING if spec.control_address else WorkerState.SERVING
        self.workers = WorkerView(list(spec.schedulers), initial)
        self.workers.prefix_weight = spec.prefix_routing_weight
        self.streams = RequestStreams()
        self._spec = spec
        self._log = log
        self._on_change = on_change  # called whenever a scheduler becomes ready or live, or stops being either
        self._auth: PeerAuth | None = None  # from the secret file, read in start()
        self._context = zmq.asyncio.Context()
        self._to_scheduler = scheduler_codec()
        self._from_scheduler = frontend_codec()
        self._outputs = self._context.socket(zmq.PULL)
        self._tasks: list[asyncio.Task] = []
        self._failed_kinds: set[str] = set()  # exception types already logged with a traceback
        self.on_load: Callable[[SchedulerState, LoadReport], None] = lambda state, report: None
        self.rejected = RejectedMessages()  # what came in on the schedulers' channel and was refused
        self.on_lost: Callable[[SchedulerState], None] = lambda state: None
        # A worker's KV events, after the prefix index took them; None: the worker is gone, and its pages with it
        # (the frontend's publisher for routers outside the box).
        self.on_kv_events: Callable[[SchedulerState, KVEvents | None], None] = lambda state, events: None
        # Every final delta whose request this link does not know: a request of a previous frontend, whose
        # scheduler aborted it when this frontend said hello (or that ended while no frontend was there), or
        # one this frontend already forgot. Its counts are the scheduler's authoritative ones; the same request
        # id may have been closed already (the callback ignores what it closed itself).
        self.on_orphan_finished: Callable[[SchedulerState, RequestDelta], None] = lambda state, delta: None

    @property
    def schedulers(self) -> list[SchedulerState]:
        return self.workers.schedulers

    @property
    def worker_set(self) -> WorkerSetView:
        return self.workers.worker_set

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

    # -- the worker view, as admission, health and the autoscaler read it ----------------------------------------

    def ready_schedulers(self, model_name: str, prefill: bool = False) -> list[SchedulerState]:
        """The model's schedulers that may take a new request: serving, ready, and live; those that generate
        (decode and mixed workers), or with `prefill` its prefill workers."""
        return self.workers.ready(model_name, Pool.PREFILL if prefill else Pool.ROUTED)

    def routed_schedulers(self, model_name: str, draw: float) -> list[SchedulerState]:
        return self.workers.routed(model_name, draw)

    def expects_capacity(self, model_name: str) -> bool:
        return self.workers.expects_capacity(model_name)

    # -- requests -------------------------------------------------------------------------------------------

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.streams

    def submit(self, scheduler: SchedulerState, message: AddRequest) -> RequestStream:
        """Starts a request on `scheduler`; its deltas come on the stream returned."""
        stream = self.streams.open(message.request_id, scheduler)
        self._send(scheduler, message)
        return stream

    def resubmit(self, stream: RequestStream, scheduler: SchedulerState, message: AddRequest) -> None:
        """Moves a stream whose part on its worker ended (a handover, a migration) to `scheduler`, where
        `message` continues it."""
        self.streams.move(stream, scheduler)
        self._send(scheduler, message)

    def abort(self, request_id: str) -> bool:
        """Asks the request's scheduler to drop it; its final counts still arrive on its stream."""
        stream = self.streams.get(request_id)
        if stream is None or not stream.scheduler.is_ready:
            return False
        self._send(stream.scheduler, AbortRequests([request_id]))
        return True

    def forget(self, stream: RequestStream) -> None:
        """The handler is done with the stream (deltas that still arrive for it are dropped)."""
        self.streams.forget(stream)

    def fail_all(self, reason: str) -> None:
        self.streams.fail_all(reason)

    def _send(self, scheduler: SchedulerState, message: msgspec.Struct) -> None:
        session = scheduler.session
        if session is None:  # never: messages go to ready workers only, and a ready opens the session
            self._log.error("unsealed_send", worker=scheduler.address.worker_id, kind=type(message).__name__)
            self._lose(scheduler, "the scheduler link lost its session; retry")
            return
        data = self._to_scheduler.encode(message)
        try:
            scheduler.socket.send_multipart([data, session.send.seal(data)], zmq.NOBLOCK)
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
        # SchedulerReady. A fresh nonce: frames of an earlier connection are worthless on this one.
        state.hello_nonce, state.session = secrets.token_bytes(_NONCE_BYTES), None
        proof = self._auth.hello_proof(self.frontend_id, state.hello_nonce)
        hello = FrontendHello(self.frontend_id, proof, state.hello_nonce)
        socket.send(self._to_scheduler.encode(hello), zmq.NOBLOCK)

    # -- the worker set --------------------------------------------------------------------------------------

    def apply_worker_set(self, message: WorkerSet) -> None:
        """Takes the daemon's set: new workers are connected, states and epochs updated, retired ones dropped;
        a worker newly draining is told so after every request already sent to it."""
        before = {s.address.worker_id: s.worker_state for s in self.schedulers}
        added, draining, dropped = self.workers.apply(message)
        for state in added:
            self._connect(state)
            self._log.info("worker_added", worker=state.address.worker_id, epoch=state.epoch,
                           state=str(state.worker_state))  # fmt: skip
        for state in self.schedulers:
            if state not in added and before.get(state.address.worker_id) != state.worker_state:
                self._log.info("worker_state", worker=state.address.worker_id, state=str(state.worker_state))
        for state in draining:
            if state.is_ready:
                self._send(state, DrainWorker(message.drain_timeout_s, self.worker_set.on_drain_timeout))
        for state in dropped:
            self._retire(state)
        self._on_change()

    def _retire(self, state: SchedulerState) -> None:
        self._log.info("worker_removed", worker=state.address.worker_id)
        self._lose(state, f"the scheduler of model {state.address.model_name!r} was retired; retry")
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
        if state.worker_state == WorkerState.DRAINING:
            await self._read_last_outputs(state)
        if state.worker_state == WorkerState.DRAINING and not self.streams.awaits_deltas(state):
            self._log.info("worker_exited", worker=state.address.worker_id, detail="drained")
        else:
            self._log.warning("scheduler_lost", worker=state.address.worker_id)
        self._lose(state, f"the scheduler of model {state.address.model_name!r} stopped; retry")
        socket.close(linger=0)  # drops whatever was queued for the dead process
        self._connect(state)

    async def _read_last_outputs(self, state: SchedulerState) -> None:
        """Waits, a moment at most, for the final deltas of a draining worker that exited to be read: without
        this, a stream whose last tokens were still queued would be lost (and moved to another worker) after its
        worker had finished it."""
        deadline = time.monotonic() + _LAST_OUTPUTS_GRACE_S
        while self.streams.awaits_deltas(state) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def _lose(self, state: SchedulerState, reason: str) -> None:
        was_ready = state.is_ready
        self.workers.prefix_index.forget(state.address.worker_id)  # its cache went with it (a reconnect resends it)
        self.on_kv_events(state, None)
        state.ready = None
        state.load = None
        state.unresponsive = False
        self.streams.lose(state, reason)
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
            frames = await self._outputs.recv_multipart()
            data, seal = frames[0], frames[1] if len(frames) == 2 else None
            try:
                if len(frames) > 2:
                    raise ValueError(f"{len(frames)} frames, not one message and its seal")
                message = self._from_scheduler.decode(data)
            except Exception as error:  # RecursionError included (see Codec.decode)
                self.rejected.count(MALFORMED)
                self._log.warning(
                    "dropped_bad_message", bytes=len(data), error_type=type(error).__name__, error=str(error)[:200]
                )
                continue
            try:
                self._handle(message, data, seal)
            except Exception as error:
                kind = type(error).__name__
                # One traceback per kind of failure: a peer repeating a bad message must not flood the log.
                self._log.error("message_failed", message=type(message).__name__, error_type=kind,
                                error=str(error)[:200], exc_info=kind not in self._failed_kinds)  # fmt: skip
                self._failed_kinds.add(kind)

    def _receiver_stopped(self, task: asyncio.Task) -> None:
        if not task.cancelled():  # then liveness calls every scheduler stuck, and health says NOT_SERVING
            self._log.error("receiver_stopped", error=repr(task.exception()))

    def _handle(self, message: ToFrontend, data: bytes, seal: bytes | None) -> None:
        state = self._scheduler(message.worker_id)
        if state is None:
            return
        if isinstance(message, SchedulerReady):
            self._on_ready(state, message)
            return
        if seal is None:
            self._forged(state, message, "unsealed")
            return
        if state.ready is None and isinstance(message, StepOutputs):
            state.unproven.append((message, data, seal))
            return
        if state.ready is None or message.incarnation != state.ready.incarnation:
            # Queued by a process that is gone or not yet ready, or sent by one that never proved itself.
            self._log.debug("dropped_stale_message", kind=type(message).__name__, worker=message.worker_id)
            return
        if not self._sealed(state, message, data, seal):
            return
        self._heard_from(state)
        if isinstance(message, StepOutputs):
            self._dispatch(state, message)
        elif isinstance(message, LoadReport):
            state.load, state.load_received_at = message, time.monotonic()
            self.on_load(state, message)
        elif isinstance(message, KVEvents):
            self.workers.prefix_index.apply(message)
            self.on_kv_events(state, message)

    def _on_ready(self, state: SchedulerState, message: SchedulerReady) -> None:
        if not self._auth.ready_is_genuine(message.worker_id, message.incarnation, message.proof, message.kv_address):
            self.rejected.count(FORGED)
            self._log.warning("forged_message", channel=TO_FRONTEND, kind="SchedulerReady", worker=message.worker_id,
                              pid=message.pid)  # fmt: skip
            return
        if state.ready is not None and state.ready.incarnation != message.incarnation:
            self._lose(state, f"the scheduler of model {state.address.model_name!r} restarted; retry")
        if state.ready is None:
            self._log.info("scheduler_ready", worker=message.worker_id, pid=message.pid, generation=message.generation)
            state.ready = message
            if state.session is None or state.session.incarnation != message.incarnation:
                # The same incarnation keeps its session (a link lost and taken again): its sequences go on.
                state.session = self._auth.session(self.frontend_id, state.hello_nonce, message.worker_id,
                                                   message.incarnation, receives=TO_FRONTEND)  # fmt: skip
            if self.worker_set.version < 0:  # the worker set, once there, is the word on its role
                state.role = message.role
            if state.worker_state == WorkerState.DRAINING:  # it was told before this frontend existed, or not at all
                view = self.worker_set
                self._send(state, DrainWorker(view.drain_timeout_s, view.on_drain_timeout))
            state.heard_at = time.monotonic()
            while state.unproven:
                earlier, data, seal = state.unproven.popleft()
                if earlier.incarnation == message.incarnation and self._sealed(state, earlier, data, seal):
                    self._dispatch(state, earlier)
            self._on_change()
        else:
            self._heard_from(state)

    def _sealed(self, state: SchedulerState, message: ToFrontend, data: bytes, seal: bytes) -> bool:
        """Whether the frame carries its session's genuine seal, with a sequence not taken yet; logged if not."""
        refused = "no_session" if state.session is None else state.session.receive.check(data, seal)
        if refused is not None:
            self._forged(state, message, refused)
        return refused is None

    def _forged(self, state: SchedulerState, message: ToFrontend, reason: str) -> None:
        self.rejected.count(FORGED)
        self._log.warning("forged_message", channel=TO_FRONTEND, kind=type(message).__name__,
                          worker=state.address.worker_id, reason=reason)  # fmt: skip

    def _dispatch(self, state: SchedulerState, message: StepOutputs) -> None:
        unread, unknown_finals = self.streams.deliver(state, message.deltas)
        if unread and state.is_ready:
            self._send(state, AbortRequests(unread))
        for delta in unknown_finals:  # after the known streams: a failing callback must not cost them deltas
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
        return self.workers.find(worker_id)
