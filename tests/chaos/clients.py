"""Real streaming requests over gRPC and HTTP/SSE, as the load and the canaries send them, each ending in a
ClientRecord: what the client saw (chunks, finish reason, final usage) and how the stream ended."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc
import httpx

from daemon.bench.stream_client import stream_generate_blocking
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

# How a stream may end. The first three are service, the next two clean failures the client was told about.
COMPLETE, ABORTED = "complete", "aborted"
REFUSED, FAILED_CLEANLY = "refused", "failed cleanly"
CUT, BROKEN, HUNG, FIVE_XX, INTERNAL, BAD = "cut", "broken", "hung", "5xx", "grpc internal", "bad answer"
_CLEAN_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
}


@dataclass(slots=True)
class ClientRecord:
    surface: str  # "grpc" or "http"
    tenant: str
    request_id: str | None  # None over HTTP: the gateway does not say which id it gave the request
    started: float  # time.time()
    ended: float = 0.0
    got_chunk: bool = False  # any token chunk (a chat stream's opening role chunk is the gateway's, not counted)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    end: str = ""
    detail: str = ""

    def finish(self, end: str, detail: str = "") -> ClientRecord:
        self.end, self.detail, self.ended = end, detail[:300], time.time()
        return self


def grpc_generate(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, metadata, tenant: str, timeout: float
) -> ClientRecord:
    record = ClientRecord("grpc", tenant, request.request_id, time.time())
    stream = stream_generate_blocking(stub, request, timeout=timeout, metadata=metadata)
    if stream.num_chunks:
        record.got_chunk = True
        record.prompt_tokens, record.completion_tokens = stream.prompt_tokens, stream.completion_tokens
        record.finish_reason = stream.finish_reason or None
    if stream.code is None:
        return _by_finish_reason(record)
    code, details = stream.code, stream.error
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return record.finish(HUNG, details)
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        return record.finish(INTERNAL, details)
    if code in _CLEAN_CODES:
        return record.finish(FAILED_CLEANLY if record.got_chunk else REFUSED, details)
    return record.finish(BAD, details)


def http_generate(client: httpx.Client, url: str, body: dict, bearer: str, tenant: str, timeout: float) -> ClientRecord:
    """A streaming completion with include_usage; the whole stream must end within `timeout`."""
    record = ClientRecord("http", tenant, None, time.time())
    deadline = time.monotonic() + timeout
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with client.stream("POST", url, json=body, headers={"Authorization": bearer}, timeout=timeout) as response:
            record.request_id = response.headers.get("x-request-id")  # used if the gateway ever says it
            if response.status_code != 200:
                return _refusal(record, response)
            for line in response.iter_lines():
                if time.monotonic() > deadline:  # keep-alive comments can hold a dead stream open
                    return record.finish(HUNG, f"stream still open after {timeout} s")
                if line.startswith("data: ") and _read_event(record, line[6:]):
                    return record
    except httpx.ConnectError as error:
        return record.finish(REFUSED, f"connect: {error}")
    except httpx.TimeoutException as error:
        return record.finish(HUNG, f"{type(error).__name__}: {error}")
    except (httpx.TransportError, httpx.StreamError) as error:
        return record.finish(BROKEN if record.got_chunk else REFUSED, f"{type(error).__name__}: {error}")
    return _by_finish_reason(record)


def _refusal(record: ClientRecord, response: httpx.Response) -> ClientRecord:
    text = response.read().decode(errors="replace")[:300]
    if response.status_code in (429, 503):
        return record.finish(REFUSED, f"{response.status_code}: {text}")
    return record.finish(FIVE_XX if response.status_code >= 500 else BAD, f"{response.status_code}: {text}")


def _read_event(record: ClientRecord, data: str) -> bool:
    """Takes in one SSE event; True once the stream has ended (an error event)."""
    if data == "[DONE]":
        return False
    try:
        event = json.loads(data)
    except ValueError:
        record.finish(BAD, f"not JSON: {data[:200]}")
        return True
    if "error" in event:
        record.finish(FAILED_CLEANLY if record.got_chunk else REFUSED, f"error event: {data[:250]}")
        return True
    for choice in event.get("choices") or ():
        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
        if text or choice.get("finish_reason"):
            record.got_chunk = True
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    usage = event.get("usage")
    if usage:
        record.prompt_tokens, record.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    return False


def _by_finish_reason(record: ClientRecord) -> ClientRecord:
    if record.finish_reason in ("stop", "length"):
        if record.prompt_tokens is None:
            return record.finish(BAD, "finished without usage")
        return record.finish(COMPLETE)
    if record.finish_reason == "abort":
        return record.finish(ABORTED)
    return record.finish(CUT, "ended without a finish reason or an error")
