"""The scheduler process's main loop: drain inputs -> step the engine -> emit, with load reports between."""

from __future__ import annotations

import os
import queue
import threading
import time
import uuid

from gpu_runtime.engine import LLMEngine
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import (
    AbortRequests,
    AddRequest,
    FrontendHello,
    LoadReport,
    RequestDelta,
    SchedulerReady,
    StepOutputs,
    ToScheduler,
)
from gpu_runtime.worker.io_threads import OutputWriter
from gpu_runtime.worker.spec import WorkerSpec


class SchedulerLoop:
    """Owns the engine thread's side: applies messages at step boundaries, steps, and reports load."""

    def __init__(self, spec: WorkerSpec, engine: LLMEngine, inbox: queue.Queue[ToScheduler], outbox: OutputWriter, log):
        self.spec = spec
        self.engine = engine
        self.incarnation = uuid.uuid4().hex
        self._inbox = inbox
        self._outbox = outbox
        self._log = log
        self._frontend_id: str | None = None
        self._stopping = threading.Event()
        self._next_report = 0.0

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        self._outbox.send(self._ready())
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain_inputs(wait_seconds=0.0 if busy else self.spec.load_report_interval_s)
            if self.engine.has_unfinished_requests():
                deltas = self.engine.step()
                if deltas:
                    self._outbox.send(StepOutputs(self.spec.worker_id, self.incarnation, deltas))
            self._report_when_due()

    # -- inputs ---------------------------------------------------------------------------------------------

    def _drain_inputs(self, wait_seconds: float) -> None:
        """Applies every queued message; when idle, first waits up to wait_seconds for one to arrive."""
        try:
            message = self._inbox.get(timeout=wait_seconds) if wait_seconds else self._inbox.get_nowait()
        except queue.Empty:
            return
        deltas: list[RequestDelta] = []
        while message is not None:
            deltas.extend(self._apply(message))
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                message = None
        if deltas:
            self._outbox.send(StepOutputs(self.spec.worker_id, self.incarnation, deltas))

    def _apply(self, message: ToScheduler) -> list[RequestDelta]:
        if isinstance(message, AddRequest):
            return self._add(message)
        if isinstance(message, AbortRequests):
            aborted = [self.engine.abort_request(request_id) for request_id in message.request_ids]
            deltas = [delta for delta in aborted if delta is not None]
            for delta in deltas:
                self._log.info(
                    "request_aborted", request_id=delta.request_id, completion_tokens=delta.num_output_tokens
                )
            return deltas
        if isinstance(message, FrontendHello):
            self._greet(message.frontend_id)
        return []

    def _add(self, message: AddRequest) -> list[RequestDelta]:
        try:
            self.engine.add_request(
                message.request_id, message.prompt_token_ids, message.sampling, message.priority, message.cache_salt
            )
        except ValueError as error:  # the frontend validates first; this is the backstop
            self._log.warning("request_refused", request_id=message.request_id, error=str(error))
            num_prompt = len(message.prompt_token_ids)
            return [RequestDelta(message.request_id, [], None, FinishReason.ERROR, num_prompt, 0, 0, str(error))]
        return []

    def _greet(self, frontend_id: str) -> None:
        if frontend_id != self._frontend_id and self._frontend_id is not None:
            # The previous frontend is gone, and with it every reader of our running requests.
            orphans = self.engine.unfinished_request_ids()
            for request_id in orphans:
                self.engine.abort_request(request_id)
            self._log.info("frontend_changed", aborted=len(orphans))
        self._frontend_id = frontend_id
        self._outbox.send(self._ready())

    # -- outputs --------------------------------------------------------------------------------------------

    def _ready(self) -> SchedulerReady:
        engine = self.engine
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
        )

    def _report_when_due(self) -> None:
        now = time.monotonic()
        if now < self._next_report:
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
            )
        )
        # The daemon's watchdog reads this file's age: it only moves while this loop does.
        os.utime(self.spec.heartbeat_path)
