"""A prefill worker's leases: the pages of prompts whose first token is out, pinned until a decode worker pulls
them or the lease expires (its decode worker died or never came), so a lost handover never leaks pages.

The engine thread grants, releases and expires leases (it alone touches the page allocator); the KV server
thread only reads which pages a lease holds, and marks a lease as being read so that it cannot expire, and its
pages be reused, in the middle of a copy.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from gpu_runtime.kv_cache.manager import KVCacheManager

# How long a read may hold a lease past its expiry: a reader that died mid-read (its unlock never comes) must not
# pin the pages for ever.
READ_LIMIT_S = 30.0


@dataclass(slots=True)
class Lease:
    page_ids: list[int]
    expires_at: float
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
            self._leases[lease_id] = Lease(list(match.page_ids), time.monotonic() + seconds)
        return list(match.page_ids), list(match.hashes)

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

    def begin_read(self, lease_id: str, page_ids: list[int]) -> str:
        """Marks the lease as being read; returns "" or why the pull is refused."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return f"lease {lease_id!r} is unknown here (expired, released, or never granted)"
            now = time.monotonic()
            if lease.reading(now):
                return f"lease {lease_id!r} is being pulled already"
            if lease.expires_at <= now:  # due: the engine thread releases it at its next look
                return f"lease {lease_id!r} expired (kv_lease_seconds)"
            held = set(lease.page_ids)
            stray = next((page for page in page_ids if page not in held), None)
            if stray is not None:
                return f"page {stray} is not held by lease {lease_id!r}"
            lease.reading_until = now + READ_LIMIT_S
            return ""

    def end_read(self, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.reading_until = 0.0

    def is_being_read(self, lease_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(lease_id)
            return lease is not None and lease.reading(time.monotonic())
