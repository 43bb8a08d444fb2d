"""What a worker's prefix cache gained and lost, as events: the frontend's prefix index routes by them, and the
frontend publishes them for routers outside the box in vLLM's wire format (frontend/kv_events_publisher.py).

A page is named by its content hash (gpu_runtime/kv_cache/page_hashes.py: chained, salted by the model, its weights'
generation and the request's cache salt), the hash the frontend computes for a prompt with the same PageHasher, so
an index of a worker's hashes answers how much of a prompt is cached there. The media are vLLM's names: "GPU" for
the KV pool (whatever its device), "CPU" for the host tier (gpu_runtime/kv_cache/host_tier.py).
"""

from __future__ import annotations

import msgspec

DEVICE_MEDIUM = "GPU"
HOST_MEDIUM = "CPU"


class PagesStored(msgspec.Struct, frozen=True, array_like=True, tag="stored"):
    """Pages now cached, in chain order: each hash's parent is the one before it, the first's is `parent`."""

    hashes: list[bytes]
    parent: bytes | None  # None: the first page of its prompt, or not known (a page stored from elsewhere)
    token_ids: list[int]  # the pages' tokens, page after page ([] where not known)
    medium: str


class PagesRemoved(msgspec.Struct, frozen=True, array_like=True, tag="removed"):
    hashes: list[bytes]
    medium: str


class AllPagesCleared(msgspec.Struct, frozen=True, array_like=True, tag="cleared"):
    pass


KVEvent = PagesStored | PagesRemoved | AllPagesCleared


class KVEventLog:
    """The events since the last `take`, a page stored right after its parent joined to its run (one event per
    prompt's new pages, as vLLM batches them)."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def stored(self, content_hash: bytes, parent: bytes | None, token_ids: list[int], medium: str) -> None:
        last = self._events[-1] if self._events else None
        joins = isinstance(last, PagesStored) and last.medium == medium and parent is not None
        # Tokens for every page of an event, or for none (an imported page's are not known here).
        if joins and last.hashes[-1] == parent and bool(last.token_ids) == bool(token_ids):
            last.hashes.append(content_hash)
            last.token_ids.extend(token_ids)
            return
        self._events.append(PagesStored([content_hash], parent, list(token_ids), medium))

    def removed(self, content_hash: bytes, medium: str) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, PagesRemoved) and last.medium == medium:
            last.hashes.append(content_hash)
            return
        self._events.append(PagesRemoved([content_hash], medium))

    def cleared(self) -> None:
        self._events = [AllPagesCleared()]

    def take(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
