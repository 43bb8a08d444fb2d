"""tokend.v1.Generation: validate and tokenize, then stream the request's RequestSession back as chunks."""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import Callable

import grpc
import msgspec
import structlog

from common.chat_template import ChatTemplateError, chat_options
from frontend.admission import AdmissionController
from frontend.auth_interceptor import calling_tenant
from frontend.embeddings import EmbedRequests
from frontend.errors import RequestError, invalid
from frontend.lifecycle import Lifecycle
from frontend.metering import Meter
from frontend.metrics import FrontendMetrics
from frontend.models import ModelCatalog
from frontend.request_session import RequestSession, SessionRequest, SessionServices
from frontend.request_stream import ChunkBuilder
from frontend.scheduler_link import SchedulerLink
from frontend.spec import TenantSpec
from frontend.structured_outputs import GrammarChecks, StructuredOutputRefused
from frontend.tenants import cache_salt, resolve_priority
from frontend.tokenize_pool import TokenizePool
from frontend.tool_calls.choice import plan as plan_tools
from frontend.tool_calls.choice import read_tools, reader_for_template
from frontend.validation import (
    PreparedRequest,
    PromptText,
    chat_messages,
    check_envelope,
    check_tokenized,
    no_room,
    prepare,
    prompt_input,
)
from gpu_runtime.ipc.messages import AddRequest, SchedulerReady
from gpu_runtime.ipc.structured_output import StructuredOutput
from gpu_runtime.tokenizer import TooManyTokens
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


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
        self._meter = meter
        self._models = models
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._tokenize = tokenize
        self.grammars = GrammarChecks(metrics)
        self.sessions = SessionServices(link, admission, meter, metrics, log, disagg_min_prompt_tokens)
        self._embeddings = EmbedRequests(self.sessions, tokenize)
        # (tenant, request id) of every request from its arrival until it holds no slot -> its session
        self._in_flight: dict[tuple[str, str], RequestSession] = {}

    @property
    def on_finished(self) -> Callable[[str, float, int, int], None]:
        """(model, arrival, prompt tokens, completion tokens) of each finished request: the autoscaler's forecast."""
        return self.sessions.on_finished

    @on_finished.setter
    def on_finished(self, callback: Callable[[str, float, int, int], None]) -> None:
        self.sessions.on_finished = callback

    @contextlib.asynccontextmanager
    async def _call_in_flight(self, context: grpc.aio.ServicerContext):
        """A call counted in flight from its start to its end; UNAVAILABLE at once while the server drains."""
        try:
            self._lifecycle.enter()
        except RequestError as error:
            await context.abort(error.code, error.message, error.trailing_metadata)
        self._metrics.requests_in_flight.inc()
        try:
            yield
        finally:
            self._metrics.requests_in_flight.dec()
            self._lifecycle.leave()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived = time.monotonic()
        async with self._call_in_flight(context):
            session = None
            outcome = "cancelled"  # unless it finishes or fails: the client went away, or its deadline passed
            try:
                session = await self._session(request, calling_tenant(), arrived)
                await session.admit()
                # Headers now: a client that sees them knows the request passed validation and is queued.
                builder = session.request.builder
                await context.send_initial_metadata((("x-request-id", builder.request_id),
                                                     ("x-model", builder.model_name)))  # fmt: skip
                async for chunk in session.chunks():
                    yield chunk
            except RequestError as error:
                outcome = "error"
                await context.abort(error.code, error.message, error.trailing_metadata)
            finally:
                if session is not None:
                    session.finish(outcome)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        arrived = time.monotonic()
        async with self._call_in_flight(context):
            try:
                model_name, model = self._model_for(request.model, calling_tenant())
                tokenizer = self._models.tokenizer(model)
                call = await self._embeddings.prepare(request, calling_tenant(), model_name, model, tokenizer)
                return await self._embeddings.run(call, arrived, tokenizer)
            except RequestError as error:
                await context.abort(error.code, error.message, error.trailing_metadata)

    async def _session(self, request: pb.GenerateRequest, tenant: TenantSpec | None, arrived: float) -> RequestSession:
        """The request validated and tokenized, as a session not yet admitted (its id now counts as in flight)."""
        model_name, model = self._model_for(request.model, tenant)
        check_envelope(request)
        self._check_generates(model)
        tokenizer = self._models.tokenizer(model)
        calls = None
        try:
            prepared = prepare(request, model, await self._prompt_token_ids(request, model, tokenizer))
            if prepared.sampling.structured_output is not None:
                await self.grammars.check(prepared.sampling.structured_output, model, tenant)
            if request.HasField("chat") and request.chat.tools_json:
                prepared, calls = await self._tool_plan(request.chat, prepared, model, tenant)
        except StructuredOutputRefused as refusal:
            self.grammars.count_refusal(refusal)
            raise
        priority = resolve_priority(tenant, prepared.priority)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        # Every log line of this call's task (and of the tasks it starts) from here on carries the id.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        # Request ids are the client's own, per tenant: another tenant's ids neither collide with them nor are
        # revealed by a refusal. Schedulers know the request by its usage record's id, unique across restarts.
        key = (tenant.name if tenant else "", request_id)
        if key in self._in_flight:
            raise invalid(f"request_id: {request_id!r} is already in flight")
        record_id = self._meter.new_record_id()
        message = AddRequest(record_id, prepared.prompt_token_ids, prepared.sampling, priority, cache_salt(tenant))
        builder = ChunkBuilder(request_id, model_name, tokenizer, prepared.stop, calls)
        facts = SessionRequest(record_id, request_id, tenant, model_name, priority, message, builder, arrived)
        session = self._in_flight[key] = RequestSession(self.sessions, facts,
                                                        on_released=lambda: self._in_flight.pop(key, None))  # fmt: skip
        return session

    def _model_for(self, requested: str, tenant: TenantSpec | None) -> tuple[str, SchedulerReady]:
        """The served model a request names, if the tenant may use it: its name, and its limits and files
        (admission picks the scheduler later)."""
        model_name = self._models.resolve(requested)
        if tenant is not None and not tenant.may_use(model_name):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, f"model: tenant {tenant.name!r} may not use {model_name!r}"
            )
        model = self._models.describe(model_name)
        if model is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model_name!r} has no scheduler up; retry")
        return model_name, model

    @staticmethod
    def _check_generates(model: SchedulerReady) -> None:
        if not model.generates:
            raise invalid(f"model: {model.model_name!r} serves embeddings only (a base model's checkpoint, without "
                          "lm_head); call Embed")  # fmt: skip

    async def Tokenize(self, request: pb.GenerateRequest, context) -> pb.TokenizeResponse:
        try:
            model_name, model = self._model_for(request.model, calling_tenant())
            check_envelope(request)
            token_ids = await self._prompt_token_ids(request, model, self._models.tokenizer(model))
        except RequestError as error:
            await context.abort(error.code, error.message, error.trailing_metadata)
        return pb.TokenizeResponse(model=model_name, token_ids=token_ids, max_model_len=model.max_model_len)

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            model_name, model = self._model_for(request.model, calling_tenant())
            if len(request.token_ids) > model.max_model_len:
                raise invalid(f"token_ids: {len(request.token_ids)} ids, more than the context of "
                              f"{model.max_model_len}")  # fmt: skip
            for index, token_id in enumerate(request.token_ids):
                if token_id >= model.vocab_size:
                    raise invalid(f"token_ids[{index}]: {token_id} is not below the vocabulary size {model.vocab_size}")
        except RequestError as error:
            await context.abort(error.code, error.message, error.trailing_metadata)
        text = self._models.tokenizer(model).decode(list(request.token_ids), skip_special_tokens=False)
        return pb.DetokenizeResponse(model=model_name, text=text)

    async def _tool_plan(self, chat: pb.ChatMessages, prepared: PreparedRequest, model, tenant):
        """The request with its tool_choice enforced (a required or named call), and the reader of its calls; each
        tool's parameters are compiled (cached) so that a schema that cannot be enforced is refused naming it."""
        tools = read_tools(chat.tools_json)
        for index, tool in enumerate(tools):
            await self.grammars.check(StructuredOutput.json_schema(tool.parameters), model, tenant,
                                      field=f"chat.tools_json[{index}].function.parameters")  # fmt: skip
        parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
        reader = model.tool_call_parser
        if reader == "auto":
            template = self._models.chat_template(model)
            reader = reader_for_template(template.text if template else "")
        tool_plan = plan_tools(tools, chat.tool_choice, parallel, reader)
        if tool_plan.constraint is not None:
            if prepared.sampling.structured_output is not None:
                raise invalid("chat.tool_choice: a required or named call cannot have a structured_output besides")
            await self.grammars.check(tool_plan.constraint, model, tenant, field="chat.tool_choice")
            sampling = msgspec.structs.replace(prepared.sampling, structured_output=tool_plan.constraint)
            prepared = dataclasses.replace(prepared, sampling=sampling)
        return prepared, tool_plan.new_reader()

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

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        tenant = calling_tenant()
        # Only the caller's own requests: another tenant's with the same id is a different request.
        session = self._in_flight.get((tenant.name if tenant else "", request.request_id))
        return pb.AbortResponse(aborted=session is not None and session.abort())

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
                    has_chat_template=ready is not None and self._models.chat_template(ready) is not None,
                    **_embedding_info(ready),
                )
            )
        return pb.ListModelsResponse(models=models)


def _embedding_info(ready: SchedulerReady | None) -> dict:
    """ModelInfo's embedding fields: how Embed pools (empty when it cannot), its vectors' size, whether it generates."""
    if ready is None:
        return {}
    pooling = ready.pooling
    return dict(pooling="" if pooling.unsupported else str(pooling.type), embedding_size=pooling.hidden_size,
                generates=ready.generates, matryoshka_dimensions=list(pooling.matryoshka_dimensions))  # fmt: skip
