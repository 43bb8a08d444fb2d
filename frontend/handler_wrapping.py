"""Rebuilding a gRPC method handler around new behaviour, keeping its kind (unary or streaming) and codecs."""

from __future__ import annotations

from collections.abc import Callable

import grpc


def same_kind(
    handler: grpc.RpcMethodHandler, unary, streaming, request_deserializer: Callable | None = None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` running `unary` or `streaming` (whichever its kind calls for),
    with its serializers, or another request deserializer when one is given."""
    common = dict(
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **common)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **common)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **common)
    return grpc.stream_stream_rpc_method_handler(streaming, **common)


def behaviour_of(handler: grpc.RpcMethodHandler):
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
