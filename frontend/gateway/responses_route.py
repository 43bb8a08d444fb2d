"""POST /v1/responses: the Responses API's stateless subset, run as the chat request it means (responses_request),
answered as one response object or as the SDK's event stream (responses_shape)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from frontend.gateway.calls import GenerateCalls
from frontend.gateway.errors import from_grpc
from frontend.gateway.json_wire import line_safe_dumps
from frontend.gateway.responses_shape import ResponsesShape


async def collect_response(calls: GenerateCalls, shape: ResponsesShape) -> dict:
    try:
        async for _, response in calls.responses():
            shape.chunk(response)
    except grpc.aio.AioRpcError as error:
        raise from_grpc(error.code(), error.details(), True, error.trailing_metadata()) from None
    finally:
        calls.cancel()
    shape.finish()
    return shape.body()


async def response_events(calls: GenerateCalls, shape: ResponsesShape, keepalive_s: float) -> AsyncIterator[str]:
    try:
        for event in shape.start():
            yield _sse(event)
        async for _, response in calls.responses(keepalive_s):
            if response is None:
                yield ": keep-alive\n\n"
                continue
            for event in shape.chunk(response):
                yield _sse(event)
        for event in shape.finish():
            yield _sse(event)
    except grpc.aio.AioRpcError as error:
        failure = from_grpc(error.code(), error.details(), True)
        yield _sse({"type": "error", "code": failure.type, "message": failure.message, "param": failure.param})
    finally:
        calls.cancel()  # also when the client goes away: the call's cancellation aborts its sequence


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {line_safe_dumps(event)}\n\n"
