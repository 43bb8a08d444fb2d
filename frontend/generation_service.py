"""tokend.v1.Generation: validate, route to a scheduler, and stream its tokens back as text chunks."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import grpc
import msgspec
import structlog

from common.chat_template import ChatTemplateError, chat_options
from frontend.admission import AdmissionController, Shed
from frontend.auth_interceptor import calling_tenant
from frontend.errors import RequestError, invalid
from frontend.lifecycle import Lifecycle
from frontend.metering import Meter, status_of
from frontend.metrics import FrontendMetrics
from frontend.migration import Migration
from frontend.models import ModelCatalog
from frontend.request_phases import RequestPhases
from frontend.request_stream import ChunkBuilder
from frontend.scheduler_link import RequestStream, SchedulerLink, SchedulerLost
from frontend.spec import TenantSpec
from frontend.tenants import cache_salt, resolve_priority
from frontend.tokenize_pool import TokenizePool
from frontend.usage_ledger import UsageRecord
from frontend.validation import (
    PromptText,
    chat_messages,
    check_envelope,
    check_tokenized,
    no_room,
    prepare,
    prompt_input,
)
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import AddRequest, RequestDelta
from gpu_runtime.tokenizer import TooManyTokens
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

# How long a cancelled request's scheduler has to report its final counts before we stop waiting.
_SETTLE_TIMEOUT_S = 10.0
# How long a migrating request waits for a worker to take it over (an in-place rollout's gap between workers).
_MIGRATE_WAIT_S = 120.0


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        link: SchedulerLink,
        models: ModelCatalog,
        lifecycle: Lifecycle,
        metrics: FrontendMetrics,
        meter: Meter,
        admission: AdmissionController,
        tokenize: TokenizePool,
        log,
        disagg_min_prompt_tokens: int = 64,
    ):
        self._disagg_min_prompt_tokens = disagg_min_prompt_tokens
        self._meter = meter
        self._admission = admission
        self._link = link
        self._models = models
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._log = log
        self._settling: set[asyncio.Task] = set()
        self._tokenize = tokenize
        # (tenant, request id) of every request from arrival to its end -> its record id, the id schedulers see
        self._record_ids: dict[tuple[str, str], str] = {}
        self._phases: dict[str, RequestPhases] = {}  # record id -> its timings, from its dispatch to its end
        self._migrations: dict[str, Migration] = {}  # record id -> what moving it to another worker takes
        # (model, arrival, prompt tokens, completion tokens) of each finished request: the autoscaler's forecast
        self.on_finished: Callable[[str, float, int, int], None] = lambda model, arrived, prompt, completion: None

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived = time.monotonic()
        try:
            self._lifecycle.enter()
        except RequestError as error:
            await context.abort(error.code, error.message, error.trailing_metadata)
        self._metrics.requests_in_flight.inc()
        stream = None
        outcome = "cancelled"  # unless it finishes or fails: the client went away, or its deadline passed
        try:
            stream, builder, record = await self._admit(request, calling_tenant())
            # Headers now: a client that sees them knows the request passed validation and is queued.
            await context.send_initial_metadata((("x-request-id", builder.request_id), ("x-model", builder.model_name)))
            async for chunk in self._chunks(stream, builder, record, arrived):
                yield chunk
        except RequestError as error:
            outcome = "error"
            await context.abort(error.code, error.message, error.trailing_metadata)
        finally:
            self._metrics.requests_in_flight.dec()
            self._lifecycle.leave()
            if stream is not None:
                self._finish(stream, builder, record, outcome)

    async def _admit(
        self, request: pb.GenerateRequest, tenant: TenantSpec | None
    ) -> tuple[RequestStream, ChunkBuilder, UsageRecord]:
        model_name = self._models.resolve(request.model)
        if tenant is not None and not tenant.may_use(model_name):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, f"model: tenant {tenant.name!r} may not use {model_name!r}"
            )
        model = self._models.describe(model_name)  # limits and files; admission picks the scheduler later
        if model is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model_name!r} has no scheduler up; retry")
        check_envelope(request)
        tokenizer = self._models.tokenizer(model)
        prepared = prepare(request, model, await self._prompt_token_ids(request, model, tokenizer))
        priority = resolve_priority(tenant, prepared.priority)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # Every log line of this call's task (and of the tasks it starts) from here on carries the id.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        # Request ids are the client's own, per tenant: another tenant's ids neither collide with them nor are
        # revealed by a refusal. Schedulers know the request by its usage record's id, unique across restarts.
        key = (tenant.name if tenant else "", request_id)
        if key in self._record_ids:
            raise invalid(f"request_id: {request_id!r} is already in flight")
        record_id = self._record_ids[key] = self._meter.new_record_id()
        cost = len(prepared.prompt_token_ids) + prepared.sampling.max_tokens
        try:
            admission_began = time.monotonic()
            scheduler = await self._admission.admit(model_name, tenant, priority, cost)
            message = AddRequest(record_id, prepared.prompt_token_ids, prepared.sampling, priority, cache_salt(tenant))
            prefill = self._prefill_worker(model_name, message, scheduler.generation)
            if prefill is None:
                stream = self._link.submit(scheduler, message, key[0] or None, cost)
            else:  # its prompt first, on a prefill worker; its first token ends that part and brings the handover
                first_part = msgspec.structs.replace(
                    message, sampling=msgspec.structs.replace(message.sampling, max_tokens=1), do_remote_decode=True
                )
                stream = self._link.submit_prefill(prefill, scheduler, first_part, key[0] or None, cost)
            submitted = time.monotonic()
            self._phases[record_id] = RequestPhases(submitted - admission_began, submitted)
            first = stream.scheduler
            self._migrations[record_id] = Migration(message, [first.generation], disaggregated=prefill is not None)
        except Shed:
            del self._record_ids[key]
            await self._meter.record_shed(record_id, request_id, key[0] or None, model_name, priority)
            raise
        except BaseException:
            del self._record_ids[key]
            raise
        self._log.info(
            "request_admitted",
            request_id=request_id,
            record_id=record_id,
            model=model_name,
            worker=stream.scheduler.address.worker_id,
            decode_worker=stream.decode_on.address.worker_id if stream.decode_on is not None else None,
            priority=priority.label,
            prompt_tokens=len(message.prompt_token_ids),
            generation=scheduler.generation,
        )
        record = self._meter.open(record_id, request_id, key[0] or None, model_name, priority)
        record.generation = scheduler.generation
        return stream, ChunkBuilder(request_id, model_name, tokenizer, prepared.stop), record

    def _prefill_worker(self, model_name: str, message: AddRequest, generation: str):
        """The prefill worker a request's prompt goes to first, or None: the model has no prefill pool on the weights
        (`generation`) of the decode worker admission chose (a rollout's or a canary's: pages of other weights are
        worthless there), or the prompt is short (a handover would cost more than computing it beside the decodes),
        or the request wants a single token (the prefill worker's answer is the whole request), or its sampling
        depends on every token it generated (a seed's draws, penalties on output tokens), which a handover would
        restart."""
        sampling = message.sampling
        if (
            len(message.prompt_token_ids) < self._disagg_min_prompt_tokens
            or sampling.max_tokens <= 1
            or sampling.seed is not None
            or sampling.presence_penalty
            or sampling.frequency_penalty
        ):
            return None
        workers = [s for s in self._link.ready_schedulers(model_name, prefill=True) if s.generation == generation]
        return min(workers, key=lambda s: s.routing_key, default=None)

    async def _prompt_token_ids(self, request: pb.GenerateRequest, model, tokenizer) -> list[int]:
        """The prompt as token ids; text is tokenized on a worker thread, never on this loop."""
        chat_prompt = await self._render_chat(request, model) if request.HasField("chat") else None
        prompt = prompt_input(request, model, chat_prompt)
        if not isinstance(prompt, PromptText):
            return prompt  # the client sent token ids
        try:
            # One token of room to generate at least: a longer prompt is refused before its ids become a list.
            token_ids = await self._tokenize.encode(
                tokenizer, prompt.text, prompt.add_special_tokens, max_tokens=model.max_model_len - 1
            )
        except TooManyTokens as error:
            raise no_room(prompt.field, error.num_tokens, model, error.exact) from None
        return check_tokenized(prompt, token_ids)

    async def _render_chat(self, request: pb.GenerateRequest, ready) -> str:
        template = self._models.chat_template(ready)
        if template is None:
            raise invalid(f"chat: model {ready.model_name!r} has no chat template; send a prompt instead")
        try:
            return await template.render_async(chat_messages(request), **chat_options(request.chat))
        except ChatTemplateError as error:
            raise invalid(f"chat.{error}") from None

    async def _chunks(self, stream: RequestStream, builder: ChunkBuilder, record: UsageRecord, arrived: float):
        last_token_at = None
        phases = self._phases.get(stream.request_id) or RequestPhases(0.0, arrived)
        migration = self._migrations.get(stream.request_id)
        while not builder.finished:
            deltas = await _next_deltas(stream)
            handing_over = stream.decode_on is not None and _prefill_done(deltas[-1], migration)
            moving = deltas[-1].migrate and migration is not None and migration.tokens_left > 0
            if moving or handing_over:  # the tokens so far go out, and the rest comes from another worker
                deltas[-1] = msgspec.structs.replace(deltas[-1], finish_reason=None, migrate=False)
            kv_params = deltas[-1].kv_transfer_params
            if stream.decode_on is not None and deltas[-1].finished:
                self._link.end_prefill(stream)  # the first token ended the request (a stop token)
            deltas = migration.counted(deltas) if migration is not None else deltas
            now = time.monotonic()
            phases.on_deltas(deltas, now)
            chunk = builder.build(deltas)
            chunk.generation = stream.scheduler.generation
            if moving:
                await self._migrate(stream, migration, record)
            elif handing_over:
                self._hand_over(stream, migration, kv_params)
            self._meter.progress(record, builder.last_delta)
            if builder.stopped_by_string and not stream.finished:
                self._link.abort(stream.request_id)  # the rest of the generation is unwanted
            num_tokens = len(chunk.token_ids)
            if num_tokens:
                labels = self._metrics.time_to_first_token.labels(builder.model_name)
                if last_token_at is None:
                    labels.observe(now - arrived)
                else:
                    itl = self._metrics.inter_token_latency.labels(builder.model_name)
                    for _ in range(num_tokens):
                        itl.observe((now - last_token_at) / num_tokens)
                last_token_at = now
            if builder.finished:
                self._metrics.e2e_request_latency.labels(builder.model_name).observe(now - arrived)
                last = builder.last_delta
                self._metrics.observe_finished(builder.model_name, phases, last.num_prompt_tokens,
                                               last.num_output_tokens)  # fmt: skip
                self.on_finished(builder.model_name, arrived, last.num_prompt_tokens, last.num_output_tokens)
                # Committed before the client can see the end: no finished request is ever missing from the ledger.
                reason = builder.finish_reason
                chunk.migrated = migration is not None and migration.migrated
                await self._close(stream, record, status_of(reason), reason, builder.last_delta)
            yield chunk

    async def _migrate(self, stream: RequestStream, migration: Migration, record: UsageRecord) -> None:
        """Sends the rest of the request to a worker new requests go to (waiting out a rollout's gap between
        workers, up to _MIGRATE_WAIT_S); UNAVAILABLE if none comes."""
        model = stream.scheduler.address.model_name
        deadline = time.monotonic() + _MIGRATE_WAIT_S
        while not (targets := [s for s in self._link.routed_schedulers(model, 0.0) if s is not stream.scheduler]):
            if time.monotonic() > deadline:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model!r}: its worker was retired and no "
                                   "other took the request over; retry")  # fmt: skip
            await asyncio.sleep(0.1)
        target = min(targets, key=lambda s: s.routing_key)
        message = migration.continuation(target.generation)
        record.generation = ",".join(migration.generations)
        self._log.info("request_migrated", record_id=stream.request_id, worker=target.address.worker_id,
                       generation=target.generation, tokens_so_far=migration.carried)  # fmt: skip
        self._link.resubmit(stream, target, message)

    def _hand_over(self, stream: RequestStream, migration: Migration, kv_params) -> None:
        """Sends the rest of a disaggregated request to its decode worker (the one admission chose, or another if
        that one went away meanwhile), with where its prompt's pages wait."""
        decode = self._link.end_prefill(stream)
        if decode is None or not decode.takes_new_requests:
            targets = self._link.routed_schedulers(stream.scheduler.address.model_name, 0.0)
            if not targets:
                raise RequestError(grpc.StatusCode.UNAVAILABLE, "no decode worker took the request over; retry")
            decode = min(targets, key=lambda s: s.routing_key)
        prefill = stream.scheduler
        message = migration.continuation(decode.generation, kv_params)
        pages = len(kv_params.remote_block_ids) if kv_params else 0
        self._log.debug("request_handed_over", record_id=stream.request_id, prefill=prefill.address.worker_id,
                        decode=decode.address.worker_id, pages=pages)  # fmt: skip
        self._link.resubmit(stream, decode, message)

    def _finish(self, stream: RequestStream, builder: ChunkBuilder, record: UsageRecord, outcome: str) -> None:
        """A request that did not run to its end is aborted, and metered once its scheduler has said what it
        really computed (tokens generated before the abort took effect included)."""
        if record.status != "running":
            self._forget(stream, record)
            return
        self._link.abort(stream.request_id)
        task = asyncio.get_running_loop().create_task(self._settle(stream, builder, record, outcome))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, stream: RequestStream, builder: ChunkBuilder, record: UsageRecord, outcome: str) -> None:
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        latest = builder.last_delta
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
            migration = self._migrations.get(stream.request_id)
            latest = migration.counted([item])[-1] if migration is not None else item
        self._forget(stream, record)
        await self._close(stream, record, outcome, builder.finish_reason or FinishReason.ABORT, latest)

    async def _close(
        self,
        stream: RequestStream,
        record: UsageRecord,
        status: str,
        finish_reason: FinishReason,
        latest: RequestDelta | None,
    ) -> None:
        if record.status != "running":
            return
        await self._meter.close(record, status, finish_reason, latest)
        self._admission.account(record.model, record.tenant, stream.priority, stream.cost, record.prompt_tokens,
                                record.completion_tokens)  # fmt: skip

    def _forget(self, stream: RequestStream, record: UsageRecord) -> None:
        """The request no longer holds a scheduler slot: the next queued one may go."""
        self._record_ids.pop((record.tenant, record.request_id), None)
        self._phases.pop(stream.request_id, None)
        self._migrations.pop(stream.request_id, None)
        if self._link.is_in_flight(stream.request_id):
            self._link.forget(stream)
            self._admission.release(stream.scheduler.address.model_name, stream.tenant, stream.priority)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        tenant = calling_tenant()
        # Only the caller's own requests: another tenant's with the same id is a different request.
        record_id = self._record_ids.get((tenant.name if tenant else "", request.request_id))
        return pb.AbortResponse(aborted=record_id is not None and self._link.abort(record_id))

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        tenant = calling_tenant()
        models = []
        for name in self._models.names:
            if tenant is not None and not tenant.may_use(name):
                continue
            ready = self._models.describe(name)
            models.append(
                pb.ModelInfo(
                    name=name,
                    max_model_len=ready.max_model_len if ready else 0,
                    vocab_size=ready.vocab_size if ready else 0,
                    ready=ready is not None,
                    aliases=[alias for alias, target in self._models.aliases.items() if target == name],
                )
            )
        return pb.ListModelsResponse(models=models)


def _prefill_done(delta: RequestDelta, migration: Migration | None) -> bool:
    """Whether a prefill worker's delta ends its part with tokens still to generate elsewhere."""
    return (
        delta.finish_reason is FinishReason.LENGTH
        and delta.num_output_tokens == 1
        and migration is not None
        and migration.tokens_left > 0
    )


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
