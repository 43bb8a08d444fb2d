"""tokend.v1.Generation/Embed: each input validated and tokenized, then run as its own request session that
generates nothing (SamplingParams.pooling, max_tokens 0): admitted, routed and metered as any prompt is, its worker's
final delta carrying the vector."""

from __future__ import annotations

import array
import asyncio
import uuid
from dataclasses import dataclass

import grpc
import structlog

from frontend.errors import RequestError, invalid
from frontend.metering import TokenCounts
from frontend.request_session import RequestSession, SessionRequest, SessionServices
from frontend.request_stream import ChunkBuilder
from frontend.spec import TenantSpec
from frontend.tenants import cache_salt, resolve_priority
from frontend.tokenize_pool import TokenizePool
from frontend.validation import MAX_CHARS_PER_TOKEN, PRIORITIES
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import AddRequest, SchedulerReady
from gpu_runtime.ipc.pooling import PoolingParams
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.tokenizer import Tokenizer, TooManyTokens
from tokend.v1 import tokend_pb2 as pb

MAX_INPUTS = 2048  # OpenAI's bound on one embeddings request
# Inputs of one call running at once: each holds an admission slot while it runs, so a call of 2048 inputs takes
# its turn beside other callers' requests instead of filling the admission queue on its own.
INPUTS_AT_ONCE = 16
MAX_REQUEST_ID_CHARS = 120  # leaves room for the `-<index>` of each input's ledger row


@dataclass(frozen=True, slots=True)
class EmbedCall:
    """A validated Embed request: what each of its inputs' sessions is made from."""

    request_id: str
    tenant: TenantSpec | None
    model_name: str
    priority: Priority
    sampling: SamplingParams
    inputs: list[list[int]]  # each input's token ids


class EmbedRequests:
    def __init__(self, sessions: SessionServices, tokenize: TokenizePool):
        self._sessions = sessions
        self._tokenize = tokenize

    async def prepare(
        self, request: pb.EmbedRequest, tenant: TenantSpec | None, model_name: str, model: SchedulerReady,
        tokenizer: Tokenizer,
    ) -> EmbedCall:  # fmt: skip
        """The request checked and tokenized; INVALID_ARGUMENT naming the first bad field."""
        request_id = request.request_id or f"emb-{uuid.uuid4().hex}"
        if len(request_id) > MAX_REQUEST_ID_CHARS or not (request_id.isascii() and request_id.isprintable()):
            raise invalid(f"request_id: must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
        if request.priority not in PRIORITIES:
            raise invalid(f"priority: unknown value {request.priority}")
        if not 1 <= len(request.inputs) <= MAX_INPUTS:
            raise invalid(f"inputs: must hold 1 to {MAX_INPUTS} inputs, got {len(request.inputs)}")
        sampling = SamplingParams(max_tokens=0, pooling=_pooling_params(request, model))
        priority = resolve_priority(tenant, PRIORITIES[request.priority])
        inputs = await asyncio.gather(*(self._token_ids(index, item, model, tokenizer)
                                        for index, item in enumerate(request.inputs)))  # fmt: skip
        return EmbedCall(request_id, tenant, model_name, priority, sampling, list(inputs))

    async def _token_ids(self, index: int, item: pb.EmbedInput, model: SchedulerReady, tokenizer) -> list[int]:
        field, which = f"inputs[{index}]", item.WhichOneof("input")
        if which == "token_ids":
            ids = list(item.token_ids.ids)
            if len(ids) > model.max_model_len:
                raise invalid(f"{field}.token_ids: {len(ids)} tokens are more than the context of "
                              f"{model.max_model_len}")  # fmt: skip
            outside = next((i for i, token in enumerate(ids) if token >= model.vocab_size), None)
            if outside is not None:
                raise invalid(f"{field}.token_ids: id {ids[outside]} at index {outside} is outside the vocabulary "
                              f"[0, {model.vocab_size})")  # fmt: skip
        elif which == "text":
            if not item.text:
                raise invalid(f"{field}.text: must not be empty")
            if len(item.text) > model.max_model_len * MAX_CHARS_PER_TOKEN:
                raise invalid(f"{field}.text: {len(item.text)} characters cannot fit the context of "
                              f"{model.max_model_len} tokens")  # fmt: skip
            try:
                ids = await self._tokenize.encode(tokenizer, item.text, True, max_tokens=model.max_model_len)
            except TooManyTokens as error:
                more = "" if error.exact else "at least "
                raise invalid(f"{field}.text: {more}{error.num_tokens} tokens are more than the context of "
                              f"{model.max_model_len}") from None  # fmt: skip
        else:
            raise invalid(f"{field}: give text or token_ids")
        if not ids:
            raise invalid(f"{field}: must not be empty (it has no tokens)")
        return ids

    async def run(self, call: EmbedCall, arrived: float, tokenizer: Tokenizer) -> pb.EmbedResponse:
        """Every input's embedding, in input order; the first failure cancels the rest (each metered as far as it
        ran) and is raised."""
        structlog.contextvars.bind_contextvars(request_id=call.request_id)
        at_once = asyncio.Semaphore(INPUTS_AT_ONCE)
        count = len(call.inputs)
        ids = [call.request_id] if count == 1 else [f"{call.request_id}-{index}" for index in range(count)]

        async def one(index: int) -> tuple[bytes, TokenCounts, str]:
            async with at_once:
                return await self._embed_one(call, ids[index], call.inputs[index], arrived, tokenizer)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(index)) for index in range(len(call.inputs))]
        except ExceptionGroup as failures:  # the first input's refusal; it cancelled the others
            first = next((error for error in failures.exceptions if isinstance(error, RequestError)), None)
            if first is None:
                raise
            raise first from None
        results = [task.result() for task in tasks]
        usage = pb.Usage(prompt_tokens=sum(counts.prompt_tokens for _, counts, _ in results),
                         cached_tokens=sum(counts.cached_tokens for _, counts, _ in results))  # fmt: skip
        return pb.EmbedResponse(
            model=call.model_name,
            embeddings=[pb.Embedding(values=array.array("f", vector)) for vector, _, _ in results],
            usage=usage,
            request_id=call.request_id,
            generation=results[0][2],
        )

    async def _embed_one(self, call: EmbedCall, request_id: str, token_ids: list[int], arrived: float,
                         tokenizer: Tokenizer) -> tuple[bytes, TokenCounts, str]:  # fmt: skip
        """One input as a session of its own; its ledger row is closed however it ends (as Generate's)."""
        record_id = self._sessions.meter.new_record_id()
        message = AddRequest(record_id, token_ids, call.sampling, call.priority, cache_salt(call.tenant))
        builder = ChunkBuilder(request_id, call.model_name, tokenizer, [])
        facts = SessionRequest(record_id, request_id, call.tenant, call.model_name, call.priority, message, builder,
                               arrived)  # fmt: skip
        session = RequestSession(self._sessions, facts, on_released=lambda: None)
        outcome = "cancelled"  # unless it finishes or fails: the client went away, or a sibling input failed
        try:
            await session.admit()
            async for _ in session.chunks():
                pass
        except RequestError:
            outcome = "error"
            raise
        finally:
            session.finish(outcome)
        if session.embedding is None:  # its worker was retired before the prompt was computed
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"inputs: {request_id}'s worker went away; retry")
        return session.embedding, session.counts or TokenCounts(), session.generations[-1]


def _pooling_params(request: pb.EmbedRequest, model: SchedulerReady) -> PoolingParams:
    """The request's pooling over the model's own; INVALID_ARGUMENT when the model cannot serve it."""
    pooling = model.pooling
    if pooling.unsupported:
        raise invalid(f"model: {model.model_name!r} cannot embed: {pooling.unsupported}")
    dimensions = request.dimensions if request.HasField("dimensions") else None
    if dimensions is not None and (why := pooling.dimensions_error(dimensions)):
        raise invalid(f"dimensions: {why}")
    normalize = request.normalize if request.HasField("normalize") else pooling.normalize
    return PoolingParams(pooling.type, normalize, dimensions)
