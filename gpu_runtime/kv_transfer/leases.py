"""A prefill worker's leases: the pages of prompts whose first token is out, pinned until a decode worker pulls
them or the lease expires (its decode worker died or never came), so a lost handover never leaks pages.

The engine thread grants, releases and expires leases (it alone touches the page allocator); the KV server
thread only reads which pages a lease holds, and marks a lease as being read so that it cannot expire, and its
pages be reused, in the middle of a copy.

A lease is a capability: its id is the request's usage-record id (in every log line), so the id alone proves
nothing. Each lease carries a random token, minted here as it is granted and handed to the decode worker only
through the frontend (KVTransferParams); every read, lock and unlock must present it, checked in constant time,
and a wrong or missing one leaves the lease untouched.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass

from gpu_runtime.kv_cache.manager import KVCacheManager

# How long a read may hold a lease past its expiry: a reader that died mid-read (its unlock never comes) must not
# pin the pages for ever.
READ_LIMIT_S = 30.0
TOKEN_BYTES = 32


@dataclass(slots=True)
class Lease:
    page_ids: list[int]
    expires_at: float
    token: bytes  # the capability a reader must present (KVTransferParams.remote_lease_token)
    reading_until: float = 0.0  # while a reader copies the pages (monotonic time); 0: nobody reads them

    def reading(self, now: float) -> bool:
        return self.reading_until > now


class KVLeases:
    def __init__(self, kv: KVCacheManager):
        self._kv = kv
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._leases)

    # -- the engine thread ---------------------------------------------------------------------------------

    def page_lists(self) -> list[list[int]]:
        """Each lease's pages: owners of their pages as much as sequences are (the integrity check counts them)."""
        with self._lock:
            return [list(lease.page_ids) for lease in self._leases.values()]

    def grant(
        self, lease_id: str, token_ids: list[int], cache_salt: str, seconds: float
    ) -> tuple[list[int], list[bytes]]:
        """Pins the cached full pages of a prompt just computed here; returns (their page ids, their hashes).
        Called right after the step that finished it, before anything could have evicted them."""
        match = self._kv.lookup(self._kv.hasher.hash_tokens(token_ids, cache_salt))
        if not match.page_ids:
            return [], []
        for page in match.page_ids:
            self._kv.allocator.share(page)
        with self._lock:
            self._leases[lease_id] = Lease(list(match.page_ids), time.monotonic() + seconds,
                                           secrets.token_bytes(TOKEN_BYTES))  # fmt: skip
        return list(match.page_ids), list(match.hashes)

    def token_of(self, lease_id: str) -> bytes:
        """The lease's token, for its KVTransferParams (b"": no such lease, e.g. the prompt filled no page)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return b"" if lease is None else lease.token

    def release(self, lease_id: str) -> bool:
        """Unpins a lease's pages (they stay cached, evictable); False if there was no such lease, or it is being
        read right now (the reader releases it when done)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.reading(time.monotonic()):
                return False
            del self._leases[lease_id]
        self._kv.allocator.free(lease.page_ids[::-1])
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Releases every lease past its time (not one being read, unless its reader outlived READ_LIMIT_S);
        returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            due = [key for key, lease in self._leases.items() if lease.expires_at <= now and not lease.reading(now)]
        return [lease_id for lease_id in due if self.release(lease_id)]

    # -- the KV server thread ------------------------------------------------------------------------------

    def begin_read(self, lease_id: str, page_ids: list[int], token: bytes) -> str:
        """Marks the lease as being read by the holder of its token; returns "" or why the pull is refused. The
        pages asked for must be the lease's own, each once: so a pull never returns more bytes than the lease's
        pages hold (a list of one page repeated would otherwise turn a small request into a huge reply)."""
        with self._lock:
            lease, refused = self._checked(lease_id, token)
            if refused:
                return refused
            now = time.monotonic()
            if lease.reading(now):
                return f"lease {lease_id!r} is being pulled already"
            if lease.expires_at <= now:  # due: the engine thread releases it at its next look
                return f"lease {lease_id!r} expired (kv_lease_seconds)"
            if not page_ids:
                return f"a pull of lease {lease_id!r} names no page"
            if len(set(page_ids)) != len(page_ids):
                return f"a pull of lease {lease_id!r} names a page more than once"
            held = set(lease.page_ids)
            stray = next((page for page in page_ids if page not in held), None)
            if stray is not None:
                return f"page {stray} is not held by lease {lease_id!r}"
            lease.reading_until = now + READ_LIMIT_S
            return ""

    def check(self, lease_id: str, token: bytes) -> str:
        """ "" if `token` is the lease's own, else why a request naming it is refused."""
        with self._lock:
            return self._checked(lease_id, token)[1]

    def end_read(self, lease_id: str, token: bytes) -> str:
        """Ends the read begun with the same token; returns "" or why it is refused (the lease then untouched)."""
        with self._lock:
            lease, refused = self._checked(lease_id, token)
            if not refused:
                lease.reading_until = 0.0
            return refused

    def _checked(self, lease_id: str, token: bytes) -> tuple[Lease | None, str]:
        """The lease if `token` is its own (constant time: the comparison must not tell how much of it matched)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None, f"lease {lease_id!r} is unknown here (expired, released, or never granted)"
        if not isinstance(token, bytes) or not hmac.compare_digest(lease.token, token):
            return None, f"lease {lease_id!r} refused: its token is missing or wrong"
        return lease, ""

    def is_being_read(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            return lease is not None and lease.reading(time.monotonic())
