"""Runs a request's gRPC Generate calls (one per choice: n for each prompt): admission first (so errors get a real
HTTP status), then either a stream of SSE events or one collected body. Whatever ends the HTTP side cancels the calls.
"""

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
    def __init__(
        self,
        stub: pb_grpc.GenerationStub,
        requests: list[pb.GenerateRequest],
        metadata,
        chat: bool,
        per_prompt: int = 0,
    ):
        self.chat = chat
        self.calls = [stub.Generate(request, metadata=metadata) for request in requests]
        # Choices per prompt, when the requests answer a batch of prompts: a refusal then names its prompt's index.
        self.per_prompt = per_prompt if 0 < per_prompt < len(requests) else 0
        self.model = ""  # the served model's name, once admitted
        # Every call is read from its start into one queue, while its siblings may still wait for a slot: an admitted
        # call must be able to stream to its end (and free its slot) even when a batch has more calls than slots.
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps = [asyncio.create_task(_pump(index, call, self._queue)) for index, call in enumerate(self.calls)]

    async def admitted(self) -> None:
        """Returns once every call passed validation and was dispatched; raises the first refusal as an OpenAIError."""
        waits = [asyncio.ensure_future(self._admission(index, call)) for index, call in enumerate(self.calls)]
        for wait in waits:  # the refusals after the first are not news: retrieved here, never logged as lost
            wait.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            for next_admitted in asyncio.as_completed(waits):
                self.model = await next_admitted or self.model
        except BaseException:
            self.cancel()
            for wait in waits:
                wait.cancel()
            raise

    async def _admission(self, index: int, call) -> str:
        """The model's name from the call's headers, once the frontend sent them; its refusal if it refused."""
        metadata = dict(await call.initial_metadata() or ())
        if call.done() and await call.code() != grpc.StatusCode.OK:
            error = from_grpc(await call.code(), await call.details(), self.chat, await call.trailing_metadata())
            if self.per_prompt and error.param == "prompt":
                error.param = f"prompt[{index // self.per_prompt}]"
                error.message = f"{error.param}: {error.message.partition(': ')[2]}"  # it began with its field
            raise error
        return metadata.get("x-model", "")

    def cancel(self) -> None:
        for call in self.calls:
            call.cancel()
        for pump in self._pumps:
            pump.cancel()

    async def collect(self, shape: ResponseShape) -> dict:
        """Reads every call to its end and returns the whole response body."""
        try:
            async for index, response in self.responses():
                shape.chunk(index, response)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), self.chat, error.trailing_metadata()) from None
        finally:
            self.cancel()
        return shape.body()

    async def events(self, shape: ResponseShape, keepalive_s: float) -> AsyncIterator[str]:
        """SSE events as the tokens arrive, from all choices interleaved; a comment keeps a quiet line open. Nothing
        but comments goes out before a choice's first token (chat's role chunk included)."""
        try:
            async for index, response in self.responses(keepalive_s):
                yield ": keep-alive\n\n" if response is None else sse_event(shape.chunk(index, response))
            if shape.include_usage:
                yield sse_event(shape.usage_chunk())
            yield "data: [DONE]\n\n"
        except grpc.aio.AioRpcError as error:
            yield sse_event(from_grpc(error.code(), error.details(), shape.chat).body())
        finally:
            # Also runs when the client goes away: the calls' cancellation aborts their sequences.
            self.cancel()

    async def responses(self, keepalive_s: float | None = None):
        """(choice index, response) as they arrive until every call ended; (None, None) after each quiet spell of
        keepalive_s. A failed call raises its AioRpcError."""
        open_calls = len(self.calls)
        while open_calls:
            try:
                index, item = await asyncio.wait_for(self._queue.get(), keepalive_s)
            except TimeoutError:
                yield None, None
                continue
            if item is _END:
                open_calls -= 1
            elif isinstance(item, grpc.aio.AioRpcError):
                raise item
            else:
                yield index, item


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
