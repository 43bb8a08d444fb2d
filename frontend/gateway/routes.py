"""The gateway's HTTP routes: OpenAI completions and chat completions, models, health, metrics, playground."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse

from frontend.gateway.calls import GenerateCalls
from frontend.gateway.errors import OpenAIError, from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_to_grpc,
    completion_to_grpc,
    decode,
)
from frontend.gateway.openai_responses import ResponseShape
from frontend.gateway.spec import GatewaySpec
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

PLAYGROUND = Path(__file__).parent / "static" / "playground.html"
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

    async def open(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.spec.grpc_address)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()

    # -- generation ---------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = decode(await request.body(), CompletionRequest)
        grpc_requests = completion_to_grpc(body, self.spec.max_n)
        return await self._generate(request, body, grpc_requests, chat=False, wants_logprobs=body.logprobs is not None)

    async def chat_completions(self, request: Request) -> Response:
        body = decode(await request.body(), ChatCompletionRequest)
        grpc_requests = chat_to_grpc(body, self.spec.max_n)
        return await self._generate(request, body, grpc_requests, chat=True, wants_logprobs=body.logprobs)

    async def _generate(self, request: Request, body, grpc_requests, chat: bool, wants_logprobs: bool) -> Response:
        metadata = _auth_metadata(request)
        calls = GenerateCalls(pb_grpc.GenerationStub(self.channel), grpc_requests, metadata, chat)
        await calls.admitted()  # a refusal becomes a real HTTP status, before any byte of a stream
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        shape = ResponseShape(chat, calls.model or body.model, len(grpc_requests), include_usage, wants_logprobs)
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
        stub = pb_grpc.GenerationStub(self.channel)
        try:
            reply = await stub.ListModels(pb.ListModelsRequest(), metadata=_auth_metadata(request), timeout=10)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), chat=False) from None
        created = int(time.time())
        data = [
            {
                "id": m.name,
                "object": "model",
                "created": created,
                "owned_by": "tokend",
                "max_model_len": m.max_model_len,
            }
            for m in reply.models
        ]
        return LineSafeJSONResponse({"object": "list", "data": data})

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
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    async def playground(self, request: Request) -> Response:
        return FileResponse(PLAYGROUND, media_type="text/html")


def _auth_metadata(request: Request) -> tuple[tuple[str, str], ...]:
    """The caller's credentials travel on to the frontend, which decides what they may do. gRPC metadata carries
    printable ASCII only (it refuses anything else as an internal error), and no issued key is anything else."""
    authorization = request.headers.get("authorization")
    if not authorization:
        return ()
    if not (authorization.isascii() and authorization.isprintable()):
        raise OpenAIError(401, "authorization: the API key must be printable ASCII", "authentication_error")
    return (("authorization", authorization),)


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
