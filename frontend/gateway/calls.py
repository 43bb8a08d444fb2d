"""Runs a request's n gRPC Generate calls: admission first (so errors get a real HTTP status), then either a
stream of SSE events or one collected body. Whatever ends the HTTP side cancels the calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from frontend.gateway.errors import from_grpc
from frontend.gateway.json_wire import line_safe_dumps
from frontend.gateway.openai_responses import ResponseShape
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_END = object()


class GenerateCalls:
    def __init__(self, stub: pb_grpc.GenerationStub, requests: list[pb.GenerateRequest], metadata, chat: bool):
        self.chat = chat
        self.calls = [stub.Generate(request, metadata=metadata) for request in requests]
        self.model = ""  # the served model's name, once admitted

    async def admitted(self) -> None:
        """Returns once every call passed validation and is queued; raises the first refusal as an OpenAIError."""
        try:
            for call in self.calls:
                metadata = dict(await call.initial_metadata() or ())
                if call.done() and await call.code() != grpc.StatusCode.OK:
                    raise from_grpc(await call.code(), await call.details(), self.chat, await call.trailing_metadata())
                self.model = metadata.get("x-model", self.model)
        except BaseException:
            self.cancel()
            raise

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()

    async def collect(self, shape: ResponseShape) -> dict:
        """Reads every call to its end and returns the whole response body."""
        try:
            for index, call in enumerate(self.calls):
                async for response in call:
                    shape.chunk(index, response)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), self.chat, error.trailing_metadata()) from None
        finally:
            self.cancel()
        return shape.body()

    async def events(self, shape: ResponseShape, keepalive_s: float) -> AsyncIterator[str]:
        """SSE events as the tokens arrive, from all choices interleaved; a comment keeps a quiet line open."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(index, call, queue)) for index, call in enumerate(self.calls)]
        try:
            if shape.chat:
                for index in range(len(self.calls)):
                    yield sse_event(shape.role_chunk(index))
            open_calls = len(self.calls)
            while open_calls:
                try:
                    index, item = await asyncio.wait_for(queue.get(), keepalive_s)
                except TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if item is _END:
                    open_calls -= 1
                elif isinstance(item, grpc.aio.AioRpcError):
                    yield sse_event(from_grpc(item.code(), item.details(), shape.chat).body())
                    return
                else:
                    yield sse_event(shape.chunk(index, item))
            if shape.include_usage:
                yield sse_event(shape.usage_chunk())
            yield "data: [DONE]\n\n"
        finally:
            # Also runs when the client goes away: the calls' cancellation aborts their sequences.
            for pump in pumps:
                pump.cancel()
            self.cancel()


async def _pump(index: int, call, queue: asyncio.Queue) -> None:
    try:
        async for response in call:
            queue.put_nowait((index, response))
        queue.put_nowait((index, _END))
    except grpc.aio.AioRpcError as error:
        queue.put_nowait((index, error))


def sse_event(payload: dict) -> str:
    """One SSE event; its JSON never holds a character a line-splitting client would cut the event at."""
    return f"data: {line_safe_dumps(payload)}\n\n"
