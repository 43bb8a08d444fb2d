"""The gateway's HTTP routes: OpenAI completions and chat completions, models, health, metrics, playground."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from frontend.gateway import request_ids
from frontend.gateway.calls import GenerateCalls
from frontend.gateway.errors import OpenAIError, from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.metrics_endpoint import MetricsEndpoint
from frontend.gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_to_grpc,
    completion_prompts,
    completion_to_grpc,
    decode,
)
from frontend.gateway.openai_responses import ResponseShape
from frontend.gateway.playground_page import page_response
from frontend.gateway.responses_request import ResponsesRequest, to_chat
from frontend.gateway.responses_route import collect_response, response_events
from frontend.gateway.responses_shape import ResponsesShape
from frontend.gateway.spec import GatewaySpec
from frontend.gateway.structured_fields import structured_param
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy may hold tokens back


class GatewayRoutes:
    def __init__(self, spec: GatewaySpec):
        self.spec = spec
        self.channel: grpc.aio.Channel | None = None
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "tokend:http_requests", "HTTP requests by route and status", ["route", "status"], registry=self.registry
        )
        self.open_streams = Gauge("tokend:http_streams_open", "SSE streams open", registry=self.registry)
        # Each model's `created`: when this gateway first listed it, so that listing and retrieving agree.
        self._first_listed: dict[str, int] = {}
        self.metrics_endpoint = MetricsEndpoint(
            self.registry, spec.metrics_socket, spec.metrics_token_sha256, spec.metrics_require_token
        )

    async def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.spec.grpc_address)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    # -- generation ---------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = decode(await request.body(), CompletionRequest)
        grpc_requests = completion_to_grpc(body, self.spec.max_n, request_ids.of(request))
        echo = await self._prompt_texts(request, body) if body.echo else None
        return await self._generate(request, body, grpc_requests, chat=False, wants_logprobs=body.logprobs is not None,
                                    echo=echo)  # fmt: skip

    async def chat_completions(self, request: Request) -> Response:
        body = decode(await request.body(), ChatCompletionRequest)
        grpc_requests = chat_to_grpc(body, self.spec.max_n, request_ids.of(request))
        return await self._generate(request, body, grpc_requests, chat=True, wants_logprobs=body.logprobs)

    async def responses(self, request: Request) -> Response:
        """The Responses API, stateless: the chat request it means, answered in its own shapes."""
        body = decode(await request.body(), ResponsesRequest)
        grpc_requests = chat_to_grpc(to_chat(body), self.spec.max_n, request_ids.of(request))
        calls = GenerateCalls(pb_grpc.GenerationStub(self.channel), grpc_requests, _auth_metadata(request), chat=True)
        await calls.admitted()
        shape = ResponsesShape(body, calls.model or body.model, request_ids.of(request))
        if not body.stream:
            return LineSafeJSONResponse(await _until_disconnect(request, collect_response(calls, shape), calls))
        events = response_events(calls, shape, self.spec.keepalive_s)
        return StreamingResponse(self._counted(events), media_type="text/event-stream", headers=_SSE_HEADERS)

    async def _prompt_texts(self, request: Request, body: CompletionRequest) -> list[str]:
        """Each prompt as text, for echo: a string as sent; token ids as the model's tokenizer decodes them."""
        stub = pb_grpc.GenerationStub(self.channel)

        async def text(prompt: str | list[int]) -> str:
            if isinstance(prompt, str):
                return prompt
            try:
                reply = await stub.Detokenize(pb.DetokenizeRequest(model=body.model, token_ids=prompt),
                                              metadata=_auth_metadata(request), timeout=10)  # fmt: skip
            except grpc.aio.AioRpcError as error:
                raise from_grpc(error.code(), error.details(), chat=False) from None
            return reply.text

        return list(await asyncio.gather(*(text(prompt) for prompt in completion_prompts(body.prompt))))

    async def _generate(
        self, request: Request, body, grpc_requests, chat: bool, wants_logprobs: bool, echo: list[str] | None = None
    ) -> Response:
        metadata = _auth_metadata(request)
        calls = GenerateCalls(pb_grpc.GenerationStub(self.channel), grpc_requests, metadata, chat, per_prompt=body.n)
        try:
            await calls.admitted()  # a refusal becomes a real HTTP status, before any byte of a stream
        except OpenAIError as error:
            if error.param == "response_format":  # the frontend's structured_output: name the field the client sent
                error.param = structured_param(body) or error.param
            raise
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        model, n = calls.model or body.model, len(grpc_requests)
        shape = ResponseShape(chat, model, n, include_usage, wants_logprobs, request_ids.of(request), per_prompt=body.n,
                              echo=echo, prompt_logprobs=body.prompt_logprobs is not None)  # fmt: skip
        if not body.stream:
            return LineSafeJSONResponse(await _until_disconnect(request, calls.collect(shape), calls))
        return StreamingResponse(
            self._counted(calls.events(shape, self.spec.keepalive_s)),
            media_type="text/event-stream",
            headers=_SSE_HEADERS,
        )

    async def _counted(self, events):
        self.open_streams.inc()
        try:
            async for event in events:
                yield event
        finally:
            self.open_streams.dec()

    # -- the rest -----------------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [_model_object(m.name, m, self._created(m.name)) for m in await self._served_models(request)]
        return LineSafeJSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        """One served model, by its name or one of its aliases (the object then has the alias as its id)."""
        wanted = request.path_params["model_id"]
        served = await self._served_models(request)
        found = next((m for m in served if wanted == m.name or wanted in m.aliases), None)
        if found is None:
            raise OpenAIError(404, f"model: {wanted!r} is not served here", "not_found_error", "model")
        return LineSafeJSONResponse(_model_object(wanted, found, self._created(found.name)))

    def _created(self, model: str) -> int:
        return self._first_listed.setdefault(model, int(time.time()))

    async def _served_models(self, request: Request) -> list[pb.ModelInfo]:
        """The models the caller may use (the frontend leaves out those its tenant may not)."""
        stub = pb_grpc.GenerationStub(self.channel)
        try:
            reply = await stub.ListModels(pb.ListModelsRequest(), metadata=_auth_metadata(request), timeout=10)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), chat=False) from None
        return list(reply.models)

    async def health(self, request: Request) -> Response:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        if serving:
            return LineSafeJSONResponse({"status": "ok"})
        return OpenAIError(
            503, "not serving: starting, draining, or a scheduler is down", "service_unavailable"
        ).response()

    async def metrics(self, request: Request) -> Response:
        return await self.metrics_endpoint.response(request)  # its own series, then the engine's

    async def playground(self, request: Request) -> Response:
        return page_response()  # with its content-security headers


def _auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's credentials travel on to the frontend, which decides what they may do. gRPC metadata carries
    printable ASCII only (it refuses anything else as an internal error), and no issued key is anything else."""
    authorization = request.headers.get("authorization")
    if not authorization:
        return ()
    if not (authorization.isascii() and authorization.isprintable()):
        raise OpenAIError(401, "authorization: the API key must be printable ASCII", "authentication_error")
    return (("authorization", authorization),)


def _model_object(model_id: str, model: pb.ModelInfo, created: int) -> dict:
    """OpenAI's model object, with vLLM's additions: `root`, the model the id names (clients such as vLLM's
    benchmark read it), `parent` (a fine-tune's base; none here) and `max_model_len`; and whether it serves chat
    (`has_chat_template`), completions (`generates`) and embeddings (`pooling`: its pooling type, or null; the
    vectors' `embedding_size`; the `matryoshka_dimensions` a request may ask for, [0] meaning any)."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "tokend",
        "root": model.name,
        "parent": None,
        "max_model_len": model.max_model_len,
        "has_chat_template": model.has_chat_template,
        "generates": model.generates,
        "pooling": model.pooling or None,
        "embedding_size": model.embedding_size,
        "matryoshka_dimensions": list(model.matryoshka_dimensions),
    }


async def _until_disconnect(request: Request, work, calls: GenerateCalls):
    """Runs a non-streaming request's work, cancelling its calls if the client hangs up first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task not in done:
        calls.cancel()
        task.cancel()
        raise OpenAIError(499, "the client closed the connection", "cancelled")
    watcher.cancel()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
