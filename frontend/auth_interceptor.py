"""AuthInterceptor: the one place a call is authenticated. Every RPC but health needs a valid API key once tenants
are configured, Admin needs an admin tenant, and handlers read who is calling from `calling_tenant()`."""

from __future__ import annotations

import contextvars

import grpc

from frontend.errors import RequestError
from frontend.handler_wrapping import behaviour_of, same_kind
from frontend.spec import TenantSpec
from frontend.tenants import Authenticator

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_ADMIN_PREFIX = "/tokend.v1.Admin/"

# Set for the call's own task before its handler runs; None while authentication is off.
_calling_tenant: contextvars.ContextVar[TenantSpec | None] = contextvars.ContextVar("calling_tenant", default=None)


def calling_tenant() -> TenantSpec | None:
    """The tenant of the call being handled (None when authentication is off)."""
    return _calling_tenant.get()


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
        return _as_tenant(handler, tenant)


def _as_tenant(handler: grpc.RpcMethodHandler, tenant: TenantSpec) -> grpc.RpcMethodHandler:
    """The real handler, run with `calling_tenant()` answering `tenant`."""
    behaviour = behaviour_of(handler)

    async def unary(request, context):
        _calling_tenant.set(tenant)
        return await behaviour(request, context)

    async def streaming(request, context):
        _calling_tenant.set(tenant)
        async for response in behaviour(request, context):
            yield response

    return same_kind(handler, unary, streaming)


def _refusing(handler: grpc.RpcMethodHandler, error: RequestError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as the real one that ends the call with the error."""

    async def refuse(request, context):
        await context.abort(error.code, error.message)

    async def refuse_stream(request, context):
        await context.abort(error.code, error.message)
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    return same_kind(handler, refuse, refuse_stream)
