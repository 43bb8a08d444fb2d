"""RequestSession: one request's life in the frontend, from admission to its one ledger row, across its workers.

A request runs as a hop plan: WHOLE on one worker, or PREFILL on a prefill worker then DECODE on the decode worker
admission chose (its slot held meanwhile); a worker retired mid-stream adds a MIGRATED hop. The moves are explicit
steps, each named by the worker's final delta: `handover` (the prefill part is done; the transfer parameters say
where the prompt's pages wait) or `migrate`. The client sees one stream: its tokens, cumulative usage over every
hop (the schedulers' authoritative counts, translated by frontend.migration), and one finish. The ledger row is
closed exactly once, with those counts, however the request ends: finished, stopped by a stop string, cancelled,
failed, or its worker lost.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import msgspec

from common.lanes import Pool
from frontend.admission import AdmissionController, Shed
from frontend.errors import RequestError, invalid
from frontend.metering import Meter, TokenCounts, status_of
from frontend.metrics import FrontendMetrics
from frontend.migration import Carryover
from frontend.prefix_index import PromptPages
from frontend.request_phases import RequestPhases
from frontend.request_stream import ChunkBuilder
from frontend.request_streams import RequestStream, SchedulerLost
from frontend.scheduler_link import SchedulerLink
from frontend.spec import TenantSpec
from frontend.usage_ledger import UsageRecord
from frontend.worker_view import SchedulerState
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import AddRequest, KVTransferParams, RequestDelta
from tokend.v1 import tokend_pb2 as pb


class HopKind(enum.Enum):
    WHOLE = "whole"  # one worker runs the request from its prompt to its end
    PREFILL = "prefill"  # a prefill worker computes the prompt and the first token, then hands the request over
    DECODE = "decode"  # the decode worker goes on from the handover, with the prompt's pages pulled
    MIGRATED = "migrated"  # a worker goes on after the previous one was retired mid-stream


@dataclass(frozen=True, slots=True)
class Hop:
    kind: HopKind
    worker: SchedulerState


class Step(enum.Enum):
    """What the session does after a batch of its current worker's deltas."""

    GO_ON = "go on"  # more deltas will come from the same worker
    HAND_OVER = "hand over"  # the prefill worker is done: the decode worker goes on
    MIGRATE = "migrate"  # the worker was retired mid-stream: another one goes on
    END = "end"  # the request is over


@dataclass(eq=False)
class SessionServices:
    """What every session of a frontend shares."""

    link: SchedulerLink
    admission: AdmissionController
    meter: Meter
    metrics: FrontendMetrics
    log: object
    disagg_min_prompt_tokens: int = 64
    settle_timeout_s: float = 10.0  # how long a cancelled request's worker has to report its final counts
    migrate_wait_s: float = 120.0  # how long a migrating request waits for a worker (a rollout's gap)
    # (model, arrival, prompt tokens, completion tokens) of each finished request: the autoscaler's forecast
    on_finished: Callable[[str, float, int, int], None] = lambda model, arrived, prompt, completion: None
    settling: set[asyncio.Task] = field(default_factory=set)  # cancelled requests waiting for their final counts


@dataclass(frozen=True, slots=True)
class SessionRequest:
    """A validated request, as the session runs it."""

    record_id: str  # its usage record's id, which its workers know it by
    request_id: str  # the client's
    tenant: TenantSpec | None
    model_name: str
    priority: Priority
    message: AddRequest  # the whole request, as the client asked for it
    builder: ChunkBuilder
    arrived: float  # time.monotonic() of its arrival

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant is not None else ""

    @property
    def cost(self) -> int:
        """Tokens it may use (prompt + max_tokens): what admission charges its tenant at dispatch."""
        return len(self.message.prompt_token_ids) + self.message.sampling.max_tokens


class RequestSession:
    def __init__(self, services: SessionServices, request: SessionRequest, on_released: Callable[[], None]):
        self._services = services
        self._link = services.link
        self.request = request
        self._on_released = on_released  # once the request holds no slot any more
        self.hops: list[Hop] = []
        self.migrated = False  # moved off a retired worker (the final chunk says so); a handover is not that
        self.record: UsageRecord | None = None  # opened once admitted
        self.counts: TokenCounts | None = None  # the request's cost so far; None until a worker said any
        self.embedding: bytes | None = None  # an embedding request's vector (float32), from its final delta
        self._carry = Carryover(request.message)
        self._held: SchedulerState | None = None  # the decode worker's slot, held while a prefill worker runs
        self._stream: RequestStream | None = None
        self._phases = RequestPhases(0.0, request.arrived)
        self._admitted = False  # holds an admission slot, given back once by _release
        self._released = False
        self._last_token_at: float | None = None
        # Its prompt's page hashes, for routing it where they are cached (computed only if two workers compete).
        self._prompt = PromptPages(request.message.prompt_token_ids, request.message.cache_salt)

    # -- admission ------------------------------------------------------------------------------------------

    async def admit(self) -> None:
        """Waits for the request's turn and sends it to its first worker; raises Shed (metered) or RequestError."""
        request = self.request
        began = time.monotonic()
        try:
            worker = await self._services.admission.admit(request.model_name, request.tenant, request.priority,
                                                          request.cost, self._prompt)  # fmt: skip
        except Shed:
            await self._services.meter.record_shed(request.record_id, request.request_id, request.tenant_name or None,
                                                   request.model_name, request.priority)  # fmt: skip
            raise
        self._admitted = True
        prefill = self._prefill_worker(worker)
        if prefill is None:
            self._start(HopKind.WHOLE, worker, request.message)
            worker.unreserve()  # the slot admission gave it is the request's now
        else:  # its prompt first, on a prefill worker; its first token ends that part and brings the handover
            self._held = worker
            sampling = msgspec.structs.replace(request.message.sampling, max_tokens=1)
            self._start(HopKind.PREFILL, prefill,
                        msgspec.structs.replace(request.message, sampling=sampling, do_remote_decode=True))  # fmt: skip
        submitted = time.monotonic()
        self._phases = RequestPhases(submitted - began, submitted)
        self._services.log.info("request_admitted", request_id=request.request_id, record_id=request.record_id,
                                model=request.model_name, worker=self.hops[0].worker.address.worker_id,
                                decode_worker=worker.address.worker_id if prefill is not None else None,
                                priority=request.priority.label, prompt_tokens=len(request.message.prompt_token_ids),
                                generation=worker.generation)  # fmt: skip
        self.record = self._services.meter.open(request.record_id, request.request_id, request.tenant_name or None,
                                                request.model_name, request.priority)  # fmt: skip
        self.record.generation = worker.generation

    def _prefill_worker(self, decode: SchedulerState) -> SchedulerState | None:
        """The prefill worker a request's prompt goes to first, or None: the model has no prefill pool on the
        weights of the decode worker admission chose (a rollout's or a canary's: pages of other weights are
        worthless there), or the prompt is short (a handover would cost more than computing it beside the
        decodes), or the request wants a single token (the prefill worker's answer is the whole request), or its
        sampling depends on every token it generated (a seed's draws, penalties on output tokens), which a
        handover would restart."""
        message = self.request.message
        sampling = message.sampling
        if (
            len(message.prompt_token_ids) < self._services.disagg_min_prompt_tokens
            or sampling.max_tokens <= 1
            or sampling.seed is not None
            or sampling.presence_penalty
            or sampling.frequency_penalty
        ):
            return None
        return self._link.workers.pick(self.request.model_name, pool=Pool.PREFILL, generation=decode.generation,
                                       prompt=self._prompt)  # fmt: skip

    def _start(self, kind: HopKind, worker: SchedulerState, message: AddRequest) -> None:
        self.hops.append(Hop(kind, worker))
        if self._stream is None:
            self._stream = self._link.submit(worker, message)
        else:
            self._link.resubmit(self._stream, worker, message)

    # -- the stream -----------------------------------------------------------------------------------------

    async def chunks(self) -> AsyncIterator[pb.GenerateResponse]:
        """The client's chunks, one per batch of deltas, until the request ends; the ledger row is closed before
        the last one goes out (no finished request is ever missing from the ledger)."""
        builder = self.request.builder
        while not builder.finished:
            deltas = await _next_deltas(self._stream)
            step = self._step_after(deltas[-1])
            self.embedding = deltas[-1].embedding or self.embedding
            self.counts = self._carry.count(deltas)
            now = time.monotonic()
            self._phases.on_deltas(deltas, now)
            chunk = builder.build(deltas, self.counts, deltas[-1].finish_reason if step is Step.END else None)
            chunk.generation = self._stream.scheduler.generation
            if builder.finished:
                self._end_on_worker(step)
            elif step is Step.HAND_OVER:
                self._hand_over(deltas[-1].handover)
            elif step is Step.MIGRATE:
                await self._migrate()
            self._services.meter.progress(self.record, self.counts)
            self._observe_tokens(len(chunk.token_ids), now)
            if builder.finished:
                chunk.migrated = self.migrated
                await self._finished(builder.finish_reason)
            yield chunk

    def _step_after(self, last: RequestDelta) -> Step:
        if last.handover is not None and self.hops[-1].kind is HopKind.PREFILL:
            return Step.HAND_OVER
        if last.migrate and self._carry.tokens_left > 0:
            return Step.MIGRATE
        return Step.END if last.finished else Step.GO_ON

    def _end_on_worker(self, step: Step) -> None:
        """The request ends here: by its worker's final delta, or by a stop string found in this chunk."""
        self._release_held()
        if step is Step.HAND_OVER or not self._stream.finished:
            # A stop string cut it: the rest of its generation, or the pages leased for a decode worker that
            # will never come, are unwanted (an abort releases a lease of the request's id).
            self._link.abort(self.request.record_id)

    def _hand_over(self, pages: KVTransferParams) -> None:
        """Sends the rest of a disaggregated request to its decode worker (the one admission chose, or another
        if that one went away meanwhile), with where its prompt's pages wait."""
        decode = self._release_held()
        if decode is None or not decode.takes_new_requests:
            decode = self._link.workers.pick(self.request.model_name)
            if decode is None:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker took the request over; retry")
        prefill = self._stream.scheduler
        pulled = self._pages_at(prefill, pages)
        message = self._carry.continuation(pulled)
        self._services.log.debug("request_handed_over", record_id=self.request.record_id,
                                 prefill=prefill.address.worker_id, decode=decode.address.worker_id,
                                 pages=len(pulled.remote_block_ids) if pulled is not None else 0)  # fmt: skip
        self._start(HopKind.DECODE, decode, message)

    def _pages_at(self, prefill: SchedulerState, pages: KVTransferParams) -> KVTransferParams | None:
        """The handover's pages for the decode worker to pull, or None for it to compute the whole prompt: none
        were leased, or they are said to wait anywhere but at the prefill worker's own KV address as its genuine
        ready named it. A decode worker stores what it pulls under the request's cache salt, so bytes from an
        address nobody vouched for could poison that tenant's prefix cache; the prompt is recomputed instead
        (exact, only slower), and the lease, if the prefill worker holds one, is released."""
        if not pages.remote_block_ids:
            return None
        known = prefill.ready.kv_address if prefill.ready is not None else ""
        if known and pages.remote_address == known and pages.remote_engine_id == prefill.address.worker_id:
            return pages
        self._services.log.warning("kv_handover_refused", record_id=self.request.record_id,
                                   prefill=prefill.address.worker_id, remote_engine_id=pages.remote_engine_id[:200],
                                   remote_address=pages.remote_address[:200], expected=known)  # fmt: skip
        self._link.abort(self.request.record_id)  # still on the prefill worker: an abort releases its lease
        return None

    async def _migrate(self) -> None:
        """Sends the rest of the request to a worker new requests go to (waiting out a rollout's gap between
        workers, up to migrate_wait_s); UNAVAILABLE if none comes."""
        self._release_held()  # a prefill worker retired mid-prompt: the request goes on whole elsewhere
        model, leaving = self.request.model_name, self._stream.scheduler
        deadline = time.monotonic() + self._services.migrate_wait_s
        while (target := self._link.workers.pick(model, exclude=leaving)) is None:
            if time.monotonic() > deadline:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model!r}: its worker was retired and no "
                                   "other took the request over; retry")  # fmt: skip
            await asyncio.sleep(0.1)
        message = self._carry.continuation()
        self.migrated = True
        self._start(HopKind.MIGRATED, target, message)
        self.record.generation = ",".join(self.generations)
        self._services.log.info("request_migrated", record_id=self.request.record_id,
                                worker=target.address.worker_id, generation=target.generation,
                                tokens_so_far=self._carry.carried)  # fmt: skip

    @property
    def generations(self) -> list[str]:
        """The weights that produced its tokens, in order: one unless it migrated (a handover keeps its weights
        unless its decode worker's differ)."""
        generations = [self.hops[0].worker.generation] if self.hops else []
        for hop in self.hops[1:]:
            if hop.kind is HopKind.MIGRATED or hop.worker.generation != generations[-1]:
                generations.append(hop.worker.generation)
        return generations

    def _observe_tokens(self, num_tokens: int, now: float) -> None:
        if not num_tokens:
            return
        metrics, model = self._services.metrics, self.request.model_name
        if self._last_token_at is None:
            metrics.time_to_first_token.labels(model).observe(now - self.request.arrived)
        else:
            itl = metrics.inter_token_latency.labels(model)
            for _ in range(num_tokens):
                itl.observe((now - self._last_token_at) / num_tokens)
        self._last_token_at = now

    async def _finished(self, reason: FinishReason) -> None:
        metrics, model, counts = self._services.metrics, self.request.model_name, self.counts or TokenCounts()
        metrics.e2e_request_latency.labels(model).observe(time.monotonic() - self.request.arrived)
        metrics.observe_finished(model, self._phases, counts.prompt_tokens, counts.completion_tokens)
        self._services.on_finished(model, self.request.arrived, counts.prompt_tokens, counts.completion_tokens)
        await self._close(status_of(reason), reason)

    # -- the end --------------------------------------------------------------------------------------------

    def abort(self) -> bool:
        """The client's Abort: its current worker is asked to drop it (its final counts still come)."""
        return self._stream is not None and self._link.abort(self.request.record_id)

    def finish(self, outcome: str) -> None:
        """The client's call is over, however it ended. A request that did not run to its end is aborted, and
        metered once its worker has said what it really computed (tokens generated before the abort took effect
        included); `outcome` is its ledger status then ("cancelled" or "error")."""
        if self.record is None or self.record.status != "running":
            self._release()
            return
        self._link.abort(self.request.record_id)
        task = asyncio.get_running_loop().create_task(self._settle(outcome))
        self._services.settling.add(task)
        task.add_done_callback(self._services.settling.discard)

    async def _settle(self, outcome: str) -> None:
        stream = self._stream
        deadline = time.monotonic() + self._services.settle_timeout_s
        while True:
            # Deltas already queued first: `finished` says the final one was sent, not that anyone read it, and
            # the client may have gone while deltas (with their newer counts) were still waiting in the queue.
            if not stream.queue.empty():
                item = stream.queue.get_nowait()
            elif stream.finished or stream.lost or (remaining := deadline - time.monotonic()) <= 0:
                break
            else:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), remaining)
                except TimeoutError:
                    break
            if isinstance(item, SchedulerLost):
                break
            self.counts = self._carry.count([item])
        self._release()
        await self._close(outcome, self.request.builder.finish_reason or FinishReason.ABORT)

    async def _close(self, status: str, finish_reason: FinishReason) -> None:
        record = self.record
        if record is None or record.status != "running":
            return
        await self._services.meter.close(record, status, finish_reason, self.counts)
        request = self.request
        self._services.admission.account(request.model_name, request.tenant_name, request.priority, request.cost,
                                         record.prompt_tokens, record.completion_tokens)  # fmt: skip

    def _release_held(self) -> SchedulerState | None:
        held, self._held = self._held, None
        if held is not None:
            held.unreserve()
        return held

    def _release(self) -> None:
        """The request holds no slot any more: the next queued one may go."""
        if self._released:
            return
        self._released = True
        self._release_held()
        if self._stream is not None:
            self._link.forget(self._stream)
        if self._admitted:
            self._services.admission.release(self.request.model_name, self.request.tenant_name or None,
                                             self.request.priority)  # fmt: skip
        self._on_released()


async def _next_deltas(stream: RequestStream) -> list[RequestDelta]:
    """Everything that arrived for the stream, waiting for at least one: a slow reader gets fewer, bigger chunks."""
    items = [await stream.queue.get()]
    while not stream.queue.empty():
        items.append(stream.queue.get_nowait())
    lost = next((item for item in items if isinstance(item, SchedulerLost)), None)
    if lost is not None:
        raise RequestError(grpc.StatusCode.UNAVAILABLE, lost.reason)
    refused = next((d for d in items if d.finish_reason is FinishReason.ERROR), None)
    if refused is not None:
        if refused.retryable:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, refused.error or "the scheduler failed; retry")
        raise invalid(refused.error or "request refused by the scheduler")
    return items
