"""The scheduler process's main loop: drain inputs -> step the engine -> emit, with load reports between."""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
import uuid

import msgspec

from common.lanes import DrainAction, Role
from gpu_runtime.engine import LLMEngine
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import (
    AbortRequests,
    AddRequest,
    DrainWorker,
    FrontendHello,
    KVEvents,
    LoadReport,
    RequestDelta,
    SchedulerReady,
    StepOutputs,
    ToScheduler,
)
from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.ipc.rejected_messages import RejectedMessages
from gpu_runtime.kv_cache.kv_events import PagesStored
from gpu_runtime.kv_transfer.puller import PagesPulled
from gpu_runtime.kv_transfer.server import LeasePulled
from gpu_runtime.step_failure import StepOutOfMemory
from gpu_runtime.worker.handover import Handover
from gpu_runtime.worker.io_threads import FrontendDisconnected, OutputWriter
from gpu_runtime.worker.spec import WorkerSpec

_RECENT_STEPS = 64  # the load report's longest_recent_step_ms looks this many steps back


_SNAPSHOT_PAGES = 100_000  # page hashes per message of a cache snapshot (about 4 MB)


class SchedulerLoop:
    """Owns the engine thread's side: applies messages at step boundaries, steps, and reports load.

    Requests are taken only once a frontend has said a genuine hello (the InputReader drops forged ones, and every
    later frame without the seal of the session that hello opened). The
    frontend sends its hello first on every connection it makes, and one connection keeps its order, so a
    frontend loses nothing by this; a peer that skips the hello gets nothing run. A disconnect does not close
    the gate again: what the gone frontend still had queued here runs and is orphaned at the next hello.

    Requests whose frontend is gone (it disconnected, or a different one said hello) are orphans: nobody reads
    their tokens, so they are aborted at once. Their final deltas, with the authoritative counts, are kept and
    sent right after the SchedulerReady that answers the next hello, for the new frontend to meter.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        engine: LLMEngine,
        inbox: queue.Queue[ToScheduler | FrontendDisconnected],
        outbox: OutputWriter,
        auth: PeerAuth,
        log,
        handover: Handover | None = None,
        incarnation: str | None = None,
        rejected: RejectedMessages | None = None,
    ):
        self.spec = spec
        self._rejected = rejected or RejectedMessages()  # the input thread's counts, which load reports carry
        # Disaggregated serving's part here (leases on a prefill worker, pulls on a decode worker); None: neither,
        # and a request that names pages elsewhere is simply computed here whole.
        self.handover = handover
        self.engine = engine
        # New at every process start (the InputReader binds its sessions to it too, so it is made before both).
        self.incarnation = incarnation or uuid.uuid4().hex
        self._inbox = inbox
        self._outbox = outbox
        self._auth = auth
        self._log = log
        self._frontend_id: str | None = None  # of the latest genuine hello; None: no frontend has greeted us
        self._orphan_finals: list[RequestDelta] = []  # final deltas of orphans, for the next hello's frontend
        self._failed_kinds: set[str] = set()  # exception types already logged with a traceback
        self._stopping = threading.Event()
        self._next_report = 0.0
        self._recent_step_seconds: collections.deque[float] = collections.deque(maxlen=_RECENT_STEPS)
        self._drain: DrainWorker | None = None  # set once the frontend said this worker is being retired
        # No deltas: what the output thread sends during a long step, so the frontend hears this scheduler is busy.
        self._keepalive = StepOutputs(spec.worker_id, self.incarnation, [])
        self._drain_deadline = 0.0
        self._kv_events = engine.kv.report_events()  # for the frontend's prefix index, sent after each step

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        self._outbox.send(self._ready())
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain_inputs(wait_seconds=0.0 if busy else self.spec.load_report_interval_s)
            if self.handover is not None:
                self.handover.expire()
            self.engine.check_ranks()  # a lost tensor-parallel rank ends this process: the daemon restarts the group
            if self.engine.has_unfinished_requests():
                self._outbox.step_started(self._keepalive)
                deltas = self.engine.step()
                self._outbox.step_ended()
                self._recent_step_seconds.append(self.engine.stats.last_step_seconds)
                if self.engine.step_failure is not None:
                    self._log_step_failure(self.engine.step_failure)
                self._send_deltas(deltas)
            self._send_kv_events()
            self._report_when_due()
            if self._drain is not None:
                self._drain_when_done()

    def _send_deltas(self, deltas: list[RequestDelta]) -> None:
        if self.handover is not None:
            deltas = self.handover.finished(deltas)
        if deltas:
            self._outbox.send(StepOutputs(self.spec.worker_id, self.incarnation, deltas))

    def _send_kv_events(self) -> None:
        """The prefix cache's changes since the last call (a step's, or a handover's imported pages)."""
        events = self._kv_events.take()
        if events:
            self._outbox.send(KVEvents(self.spec.worker_id, self.incarnation, events))

    def _has_work(self) -> bool:
        """Requests running here, or waiting for their pages, or pages leased to a decode worker."""
        if self.engine.has_unfinished_requests():
            return True
        return self.handover is not None and (self.handover.has_pending or len(self.handover.leases) > 0)

    def _unfinished_ids(self) -> list[str]:
        pending = self.handover.pending_ids() if self.handover is not None else []
        return self.engine.unfinished_request_ids() + pending

    def _end(self, request_id: str) -> RequestDelta | None:
        """Aborts a request wherever it is here (running, queued, or waiting for its pages); its final delta."""
        delta = self.engine.abort_request(request_id)
        if self.handover is not None:
            pending = self.handover.abort(request_id)
            delta = delta or pending
        return delta

    def _drain_when_done(self) -> None:
        """A draining worker stops once nothing runs here and it holds no lease; past its timeout, it ends what
        still runs first (a lease then lasts until it is pulled or expires)."""
        if self._unfinished_ids() and time.monotonic() >= self._drain_deadline:
            migrate = self._drain.on_timeout == DrainAction.MIGRATE
            deltas = []
            for request_id in self._unfinished_ids():
                delta = self._end(request_id)
                if delta is not None:
                    deltas.append(msgspec.structs.replace(delta, migrate=migrate))
            self._log.warning("drain_timeout", ended=len(deltas), action=self._drain.on_timeout)
            self._send_deltas(deltas)
        if not self._has_work():
            self._log.info("drained", detail="every stream ended; exiting")
            self._report_when_due(force=True)
            self.stop()

    def _log_step_failure(self, failure: StepOutOfMemory) -> None:
        self._log.error(
            "step_out_of_memory",
            device=failure.device,
            step_tokens=failure.num_tokens,
            failed_requests=list(failure.failed_request_ids),
            max_num_batched_tokens=failure.token_budget,
            detail="the step's requests failed; the others go on, in smaller steps",
        )

    # -- inputs ---------------------------------------------------------------------------------------------

    def _drain_inputs(self, wait_seconds: float) -> None:
        """Applies every queued message; when idle, first waits up to wait_seconds for one to arrive."""
        try:
            message = self._inbox.get(timeout=wait_seconds) if wait_seconds else self._inbox.get_nowait()
        except queue.Empty:
            return
        deltas: list[RequestDelta] = []
        while message is not None:
            deltas.extend(self._apply_safely(message))
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                message = None
        self._send_deltas(deltas)

    def _apply_safely(self, message: ToScheduler | FrontendDisconnected) -> list[RequestDelta]:
        """_apply, except that a message the engine chokes on costs that message only, not every request here."""
        try:
            return self._apply(message)
        except Exception as error:
            kind = type(error).__name__
            first = kind not in self._failed_kinds
            self._failed_kinds.add(kind)
            # One traceback per kind of failure: a peer repeating a bad message must not flood the log.
            self._log.error("message_failed", message=type(message).__name__, error_type=kind, error=str(error)[:200],
                            exc_info=first)  # fmt: skip
            if isinstance(message, AddRequest) and message.request_id not in self._unfinished_ids():
                num_prompt = len(message.prompt_token_ids)
                reason = f"the scheduler failed on this request ({kind})"
                return [RequestDelta(message.request_id, [], None, FinishReason.ERROR, num_prompt, 0, 0, reason)]
            return []

    def _apply(self, message: ToScheduler | FrontendDisconnected) -> list[RequestDelta]:
        if isinstance(message, FrontendHello):
            self._greet(message.frontend_id)
            return []
        if isinstance(message, FrontendDisconnected):
            self._orphan_all("frontend_disconnected")
            return []
        if isinstance(message, LeasePulled):
            self.handover.lease_pulled(message)
            return []
        if isinstance(message, PagesPulled):
            return self.handover.pulled(message, self._add)
        if self._frontend_id is None:
            self._log.warning("dropped_before_hello", kind=type(message).__name__)
            return []
        if isinstance(message, AddRequest):
            return self.handover.add(message, self._add) if self.handover is not None else self._add(message)
        if isinstance(message, DrainWorker):
            if self._drain is None:
                self._drain = message
                self._drain_deadline = time.monotonic() + message.timeout_s
                self._log.info("draining", running=len(self.engine.unfinished_request_ids()),
                               timeout_s=message.timeout_s, on_timeout=message.on_timeout)  # fmt: skip
            return []
        if isinstance(message, AbortRequests):
            aborted = [self._end(request_id) for request_id in message.request_ids]
            deltas = [delta for delta in aborted if delta is not None]
            for delta in deltas:
                self._log.info(
                    "request_aborted", request_id=delta.request_id, completion_tokens=delta.num_output_tokens
                )
            return deltas
        return []

    def _add(self, message: AddRequest) -> list[RequestDelta]:
        try:
            self.engine.add_request(message.request_id, message.prompt_token_ids, message.sampling, message.priority,
                                    message.cache_salt, message.num_generated)  # fmt: skip
        except ValueError as error:  # the frontend validates first; this is the backstop
            self._log.warning("request_refused", request_id=message.request_id, error=str(error))
            num_prompt = len(message.prompt_token_ids)
            return [RequestDelta(message.request_id, [], None, FinishReason.ERROR, num_prompt, 0, 0, str(error))]
        return []

    def _greet(self, frontend_id: str) -> None:
        if frontend_id != self._frontend_id and self._frontend_id is not None:
            # The previous frontend is gone, and with it every reader of our running requests.
            self._orphan_all("frontend_changed")
        self._frontend_id = frontend_id
        self._outbox.send(self._ready())
        if self._orphan_finals:
            # After the ready: the frontend takes outputs only from an incarnation it has seen say ready.
            self._outbox.send(StepOutputs(self.spec.worker_id, self.incarnation, self._orphan_finals))
            self._log.info("orphans_reported", count=len(self._orphan_finals))
            self._orphan_finals = []
        # Everything cached now (the changes not sent yet are in it): the new frontend's index starts from this, in
        # messages of at most _SNAPSHOT_PAGES hashes (a large host tier's would pass the receiver's size limit).
        self._kv_events.take()
        chunks = [PagesStored(hashes[i : i + _SNAPSHOT_PAGES], None, [], medium)
                  for medium, hashes in self.engine.kv.cached_hashes().items()
                  for i in range(0, max(len(hashes), 1), _SNAPSHOT_PAGES)]  # fmt: skip
        for i, chunk in enumerate(chunks):
            self._outbox.send(KVEvents(self.spec.worker_id, self.incarnation, [chunk], snapshot=i == 0))

    def _orphan_all(self, reason: str) -> None:
        """Aborts every request (their frontend is gone) and keeps their final counts for the next frontend."""
        orphans = self._unfinished_ids()
        for request_id in orphans:
            delta = self._end(request_id)
            if delta is not None:
                self._orphan_finals.append(delta)
        if orphans:
            self._log.info("orphans_aborted", reason=reason, aborted=len(orphans))

    def _handover_load(self) -> dict:
        if self.handover is None:
            return {}
        stats = self.handover.stats
        return dict(kv_pulled_pages=stats.pulled_pages, kv_pulled_bytes=stats.pulled_bytes,
                    kv_pull_seconds=stats.pull_seconds, kv_pull_failures=stats.pull_failures,
                    kv_leases_held=len(self.handover.leases))  # fmt: skip

    # -- outputs --------------------------------------------------------------------------------------------

    def _ready(self) -> SchedulerReady:
        engine = self.engine
        kv_address = self.spec.kv_address if self.spec.role == Role.PREFILL else ""  # only prefill workers serve pulls
        return SchedulerReady(
            worker_id=self.spec.worker_id,
            incarnation=self.incarnation,
            pid=os.getpid(),
            model_name=engine.model_name,
            model_dir=str(engine.model_dir),
            group=self.spec.group,
            max_model_len=engine.model_config.max_model_len,
            vocab_size=engine.model_config.vocab_size,
            num_pages=engine.kv.num_pages,
            page_size=engine.kv.page_size,
            max_num_seqs=engine.config.max_num_seqs,
            proof=self._auth.ready_proof(self.spec.worker_id, self.incarnation, kv_address),
            sampling_defaults=engine.sampling_defaults,
            chat_template=engine.chat_template,
            generation=engine.generation,
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            role=self.spec.role,
            kv_address=kv_address,
            eos_token_ids=tuple(engine.model_config.eos_token_ids),
            tool_call_parser=engine.config.tool_call_parser,
            pooling=engine.pooling,
            generates=engine.model_config.generates,
            kv_windows=list(engine.kv.windows),
            max_prefill_chunk=engine.max_prefill_chunk,
        )

    def _report_when_due(self, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next_report and not force:
            return
        self._next_report = now + self.spec.load_report_interval_s
        snapshot = self.engine.snapshot()
        projections = self.engine.scheduler.projected_ttft_seconds()
        self._outbox.send(
            LoadReport(
                worker_id=self.spec.worker_id,
                incarnation=self.incarnation,
                num_running=snapshot.num_running,
                num_running_batch=sum(s.priority == Priority.BATCH for s in self.engine.scheduler.running),
                num_waiting=snapshot.num_waiting,
                kv_cache_usage=snapshot.kv_cache_usage,
                num_pages=snapshot.num_pages,
                num_used_pages=snapshot.num_used_pages,
                prefix_query_tokens=snapshot.prefix_query_tokens,
                prefix_hit_tokens=snapshot.prefix_hit_tokens,
                num_preemptions=snapshot.num_preemptions,
                projected_ttft_seconds=max(projections.values(), default=0.0),
                mean_step_ms=snapshot.mean_step_ms,
                sent_at=time.time(),
                longest_recent_step_ms=1e3 * max(self._recent_step_seconds, default=0.0),
                iteration_token_counts=list(self.engine.stats.iteration_token_counts),
                iteration_tokens_sum=self.engine.stats.iteration_tokens_sum,
                generation=self.engine.generation,
                draining=self._drain is not None,
                **self._handover_load(),
                messages_malformed=self._rejected.malformed,
                messages_forged=self._rejected.forged,
                prefix_host_hit_tokens=snapshot.prefix_host_hit_tokens,
                kv_offloaded_pages=snapshot.kv_offloaded_pages,
                kv_loaded_pages=snapshot.kv_loaded_pages,
                kv_host_pages=snapshot.kv_host_pages,
                seconds_per_token=self.engine.scheduler.policy.model.seconds_per_token,
            )
        )
        # The daemon's watchdog reads this file's age: it only moves while this loop does.
        os.utime(self.spec.heartbeat_path)
