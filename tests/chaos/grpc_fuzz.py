"""Sends fuzzed gRPC calls (typed messages, and raw bytes through identity serializers) and judges each status."""

from __future__ import annotations

import grpc

from chaos.grpc_messages import build_request
from chaos.report import Outcome
from tokend.v1 import tokend_pb2_grpc as pb_grpc

# Status codes the contract documents; INTERNAL and UNKNOWN mean an exception escaped, DEADLINE_EXCEEDED a hang.
_LOSSES = {
    grpc.StatusCode.INTERNAL: "grpc_internal",
    grpc.StatusCode.UNKNOWN: "grpc_internal",
    grpc.StatusCode.DEADLINE_EXCEEDED: "hung",
}
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)


class GrpcFuzzer:
    """One channel for typed and raw calls; every call has the per-input deadline."""

    def __init__(self, address: str, timeout: float):
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.timeout = timeout

    def close(self) -> None:
        self.channel.close()

    def send_message(self, call: tuple[dict, tuple]) -> Outcome:
        fields, metadata = call
        try:
            request = build_request(fields)
        except (ValueError, TypeError) as error:
            return Outcome("not sent: protobuf refused a value", None, str(error))
        return _first_answer(self.stub.Generate(request, metadata=metadata, timeout=self.timeout), stream=True)

    def send_raw(self, call: tuple[tuple[str, str], bytes], metadata: tuple) -> Outcome:
        (method, kind), data = call
        if kind == "stream":
            callable_ = self.channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            return _first_answer(callable_(data, metadata=metadata, timeout=self.timeout), stream=True)
        callable_ = self.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            callable_(data, metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as error:
            return _judge_error(error)
        return Outcome("OK")


def _first_answer(call, stream: bool) -> Outcome:
    """Reads the first chunk (then cancels: generation is not what is fuzzed) or the status."""
    try:
        for _ in call:
            call.cancel()
            return Outcome("OK, streaming")
    except grpc.RpcError as error:
        return _judge_error(error)
    return Outcome("OK without any chunk", "cut_streams", "the stream ended with OK before any chunk or finish reason")


def _judge_error(error: grpc.RpcError) -> Outcome:
    code = error.code()
    if code is None:
        return Outcome("no status", "bad_answers", repr(error)[:300])
    details = error.details() or ""
    return Outcome(code.name, _LOSSES.get(code), f"{code.name}: {details}")
