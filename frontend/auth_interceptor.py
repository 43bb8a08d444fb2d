"""AuthInterceptor: the one place a call is authenticated. Every RPC but health needs a valid API key once tenants
are configured, Admin needs an admin tenant (or the daemon's local admin token), the mutating Admin RPCs need the
local admin token while there are no tenants, and handlers read who is calling from `calling_tenant()`."""

from __future__ import annotations

import contextvars
import hashlib
import hmac

import grpc

from frontend.errors import RequestError
from frontend.handler_wrapping import behaviour_of, same_kind
from frontend.spec import TenantSpec
from frontend.tenants import Authenticator, bearer_of, has_authorization

_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
_ADMIN_PREFIX = "/tokend.v1.Admin/"
# What changes the daemon: with tenants off, any local user may still read the load, the rollouts and the usage.
MUTATING_ADMIN_METHODS = frozenset({"/tokend.v1.Admin/Drain", "/tokend.v1.Admin/Rollout"})

# Set for the call's own task before its handler runs; None while authentication is off.
_calling_tenant: contextvars.ContextVar[TenantSpec | None] = contextvars.ContextVar("calling_tenant", default=None)


def calling_tenant() -> TenantSpec | None:
    """The tenant of the call being handled (None when authentication is off, or for the local admin token)."""
    return _calling_tenant.get()


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator, admin_token_sha256: str = "", admin_token_path: str = ""):
        self._authenticator = authenticator
        # The daemon's local admin token (daemon.admin_token), as its hash: "" = none, and with no tenants the
        # mutating Admin RPCs are then refused to everyone (a frontend run without a daemon).
        self._admin_token_sha256 = admin_token_sha256
        self._admin_token_path = admin_token_path

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        metadata = details.invocation_metadata
        if details.method.startswith(_ADMIN_PREFIX) and self._is_local_admin(metadata):
            return handler  # an admin whether or not there are tenants; no tenant to meter
        if not self._authenticator.enabled:
            if details.method in MUTATING_ADMIN_METHODS:
                return _refusing(handler, self._local_admin_refusal(details.method, metadata))
            return handler
        try:
            tenant = self._authenticator.authenticate(metadata)
            if details.method.startswith(_ADMIN_PREFIX) and not tenant.admin:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} is not an admin")
        except RequestError as error:
            return _refusing(handler, error)
        return _as_tenant(handler, tenant)

    def _is_local_admin(self, metadata) -> bool:
        presented = bearer_of(metadata)
        if not presented or not self._admin_token_sha256:
            return False
        digest = hashlib.sha256(presented.encode(errors="surrogateescape")).hexdigest()
        return hmac.compare_digest(digest, self._admin_token_sha256)

    def _local_admin_refusal(self, method: str, metadata) -> RequestError:
        """UNAUTHENTICATED with no credential at all, PERMISSION_DENIED with a wrong one; either way, how to call."""
        where = f"the token in {self._admin_token_path}" if self._admin_token_path else "the daemon's admin token"
        message = (f"authorization: {method.rsplit('/', 1)[-1]} needs the local admin credential while no [[tenants]] "
                   f"are configured: send 'Bearer <token>' with {where} (tokend rollout reads it from the daemon's "
                   "--state-dir), or configure a tenant with admin = true")  # fmt: skip
        code = grpc.StatusCode.PERMISSION_DENIED if has_authorization(metadata) else grpc.StatusCode.UNAUTHENTICATED
        return RequestError(code, message)


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
