"""The frontend's error funnel on a real grpc.aio server: what a handler did not expect becomes INTERNAL with an
incident id the log names once; deliberate statuses and cancellations pass through untouched."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from frontend.error_interceptor import ErrorInterceptor
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


class RecordingLog:
    """Stands in for the structlog logger: keeps each event and its fields."""

    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def error(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    def info(self, event: str, **fields) -> None:
        self.events.append((event, fields))


class FaultyGeneration(pb_grpc.GenerationServicer):
    async def Generate(self, request, context):
        if request.prompt == "outlived":
            # Meanwhile the client cancels; a real handler can be past its last await when that lands.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.5)
            await context.send_initial_metadata((("x-request-id", "late"),))  # fails: the call is over
        yield pb.GenerateResponse(text="first")
        if request.prompt == "deliberate":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "deliberately refused")
        raise KeyError("a bug after the first chunk")

    async def Abort(self, request, context):
        raise ZeroDivisionError("a bug in a unary handler")


async def _serve_and_call(log: RecordingLog):
    server = grpc.aio.server(interceptors=[ErrorInterceptor(log)])
    pb_grpc.add_GenerationServicer_to_server(FaultyGeneration(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    outcomes = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            for prompt in ("buggy", "deliberate"):
                chunks = []
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for chunk in stub.Generate(pb.GenerateRequest(prompt=prompt), timeout=10):
                        chunks.append(chunk.text)
                outcomes[prompt] = (chunks, caught.value.code(), caught.value.details())
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Abort(pb.AbortRequest(request_id="x"), timeout=10)
            outcomes["abort"] = ([], caught.value.code(), caught.value.details())
            outlived = stub.Generate(pb.GenerateRequest(prompt="outlived"), timeout=10)
            await asyncio.sleep(0.1)
            outlived.cancel()
            await asyncio.sleep(1.0)  # the handler runs on into the cancelled call
    finally:
        await server.stop(None)
    return outcomes


def test_unexpected_exceptions_become_internal_with_an_incident_logged_once():
    log = RecordingLog()
    outcomes = asyncio.run(_serve_and_call(log))
    chunks, code, details = outcomes["buggy"]
    assert chunks == ["first"] and code == grpc.StatusCode.INTERNAL and "incident err-" in details
    _, code, abort_details = outcomes["abort"]
    assert code == grpc.StatusCode.INTERNAL and "incident err-" in abort_details
    # A status the handler chose is the client's answer as it is, and is no incident.
    assert outcomes["deliberate"][1:] == (grpc.StatusCode.RESOURCE_EXHAUSTED, "deliberately refused")
    incidents = [fields["incident"] for event, fields in log.events if event == "unexpected_error"]
    assert len(incidents) == 2 and all(incident in details + abort_details for incident in incidents)
    # A handler failing to talk to a client that already left is no incident.
    assert [event for event, _ in log.events if event == "call_ended_under_handler"] == ["call_ended_under_handler"]
