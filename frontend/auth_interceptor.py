"""AuthInterceptor: every RPC but health needs a valid API key once tenants are configured; Admin needs an admin."""

from __future__ import annotations

import grpc

from frontend.tenants import Authenticator
from frontend.validation import RequestError

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_ADMIN_PREFIX = "/tokend.v1.Admin/"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator):
        self._authenticator = authenticator

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not self._authenticator.enabled or details.method.startswith(_OPEN_PREFIXES):
            return handler
        try:
            tenant = self._authenticator.authenticate(details.invocation_metadata)
            if details.method.startswith(_ADMIN_PREFIX) and not tenant.admin:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} is not an admin")
        except RequestError as error:
            return _refusing(handler, error)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, error: RequestError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as the real one that ends the call with the error."""

    async def refuse(request, context):
        await context.abort(error.code, error.message)

    async def refuse_stream(request, context):
        await context.abort(error.code, error.message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    common = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **common)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **common)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **common)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **common)
