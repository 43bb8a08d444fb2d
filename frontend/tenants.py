"""Tenants and their API keys: who is calling, and what they may use.

Keys are never held in clear: the config carries each key's SHA-256, and a presented key is hashed and then
compared with every configured hash in constant time, so timing reveals neither a key nor which tenant matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

import grpc

from frontend.errors import RequestError
from frontend.spec import TenantSpec
from gpu_runtime.ipc.enums import Priority


class Authenticator:
    """Finds the tenant of a call from its `authorization: Bearer <key>` metadata."""

    def __init__(self, tenants: list[TenantSpec]):
        self.tenants = tenants

    def replace(self, tenants: list[TenantSpec]) -> None:
        """A reload's tenants, for every call from now on; a call already authenticated keeps the tenant it had."""
        self.tenants = list(tenants)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> TenantSpec | None:
        """The calling tenant; None when authentication is off. UNAUTHENTICATED for a missing or unknown key."""
        if not self.enabled:
            return None
        key = bearer_of(metadata)
        if not key:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization: send 'Bearer <API key>'")
        digest = hashlib.sha256(key.encode()).hexdigest()
        match = None
        for tenant in self.tenants:  # no early exit: every hash is compared, in constant time
            if hmac.compare_digest(digest, tenant.api_key_sha256):
                match = tenant
        if match is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "authorization: unknown API key")
        return match


def bearer_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The key of a call's `authorization: Bearer <key>` metadata; "" when it sends none (or not as a bearer)."""
    value = next((v for k, v in metadata or () if k == "authorization"), None)
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not value or not value.startswith("Bearer "):
        return ""
    return value[7:].strip()


def has_authorization(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    return any(k == "authorization" for k, _ in metadata or ())


def resolve_priority(tenant: TenantSpec | None, requested: Priority | None) -> Priority:
    """The class a request runs in: what it asked for, else its tenant's default; never above the tenant's max."""
    if tenant is None:
        return requested if requested is not None else Priority.INTERACTIVE
    priority = requested if requested is not None else Priority.from_label(tenant.priority)
    if priority < Priority.from_label(tenant.max_priority):  # lower value = more urgent
        raise RequestError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"priority: tenant {tenant.name!r} may not ask for {priority.label} (at most {tenant.max_priority})",
        )
    return priority


def cache_salt(tenant: TenantSpec | None) -> str:
    """What a tenant's prompts' page hashes are salted with: its own name, or the cache group the operator gave
    it, so cached_tokens never tells one tenant what another recently sent. Sharing takes every tenant of the
    group to name it: a group cannot be named after a tenant to read that tenant's cache."""
    if tenant is None:
        return ""  # authentication off: one tenant
    return f"group:{tenant.cache_group}" if tenant.cache_group else f"tenant:{tenant.name}"
