"""ErrorInterceptor: the frontend's one error funnel. Bytes that are not the method's message are refused
INVALID_ARGUMENT; any exception a handler did not expect becomes INTERNAL with an incident id, logged once."""

from __future__ import annotations

import asyncio
import uuid

import grpc

from frontend.handler_wrapping import behaviour_of, same_kind


class _Undecodable:
    """Stands for a request whose bytes did not decode: the handler answers it instead of grpc (which says
    UNKNOWN and logs a traceback for every such call)."""

    def __init__(self, error: Exception):
        self.error = error


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, log):
        self._log = log

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._funnelled(handler, details.method)

    def _funnelled(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        decode, behaviour, log = handler.request_deserializer, behaviour_of(handler), self._log

        def tolerant_decode(data: bytes):
            try:
                return decode(data)
            except Exception as error:  # protobuf's DecodeError, or anything else bad bytes raise
                return _Undecodable(error)

        async def check(request, context) -> None:
            if isinstance(request, _Undecodable):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message for {method} ({request.error})"
                )

        async def unexpected(error: Exception, context) -> None:
            incident = f"err-{uuid.uuid4().hex[:12]}"
            try:
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error (incident {incident}); retry")
            except grpc.aio.AbortError:
                log.error("unexpected_error", method=method, incident=incident, error=repr(error)[:300], exc_info=error)
                raise
            except Exception:
                # No status can be set any more: the call ended under the handler (the client cancelled, or its
                # deadline passed), and what failed was talking to a caller who is gone. Not an incident.
                log.info("call_ended_under_handler", method=method, error=repr(error)[:200])

        async def unary(request, context):
            await check(request, context)
            try:
                return await behaviour(request, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise  # the client left, or the handler chose its status
            except Exception as error:
                await unexpected(error, context)

        async def streaming(request, context):
            await check(request, context)
            try:
                async for response in behaviour(request, context):
                    yield response
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as error:
                await unexpected(error, context)

        # A request stream (reflection's) is decoded message by message inside the handler's iterator: grpc's own
        # handling stays there, and only a single request's decoding is answered here.
        decoder = decode if handler.request_streaming else tolerant_decode
        return same_kind(handler, unary, streaming, request_deserializer=decoder)
