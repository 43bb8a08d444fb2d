"""Which prompt pages each worker holds, kept from the workers' KV events: how many of a prompt's leading tokens a
worker would find cached, for routing a request where its pages are (frontend/worker_view.py `pick`).

A worker's pages are named by their content hashes (gpu_runtime/kv_cache/page_hashes.py), salted with the model,
its weights' generation and the request's cache salt. `PromptPages` hashes a prompt the same way, once per salt and
page size, so a hit counts only where the salted hash matches: another tenant's pages or another generation's never
count, and a worker rolled onto new weights starts cold.
"""

from __future__ import annotations

from gpu_runtime.ipc.messages import KVEvents, SchedulerReady
from gpu_runtime.kv_cache.kv_events import DEVICE_MEDIUM, AllPagesCleared, PagesRemoved, PagesStored
from gpu_runtime.kv_cache.page_hashes import PageHasher, model_salt

_DEVICE, _HOST = 1, 2  # which tiers of a worker hold a page (a bit each)


def _tier(medium: str) -> int:
    return _DEVICE if medium == DEVICE_MEDIUM else _HOST


class PrefixIndex:
    def __init__(self) -> None:
        self._pages: dict[str, dict[bytes, int]] = {}  # worker id -> content hash -> the tiers holding it

    def apply(self, message: KVEvents) -> None:
        pages = self._pages.setdefault(message.worker_id, {})
        if message.snapshot:
            pages.clear()
        for event in message.events:
            if isinstance(event, PagesStored):
                tier = _tier(event.medium)
                for content_hash in event.hashes:
                    pages[content_hash] = pages.get(content_hash, 0) | tier
            elif isinstance(event, PagesRemoved):
                tier = _tier(event.medium)
                for content_hash in event.hashes:
                    left = pages.get(content_hash, 0) & ~tier
                    if left:
                        pages[content_hash] = left
                    else:
                        pages.pop(content_hash, None)
            elif isinstance(event, AllPagesCleared):
                pages.clear()

    def forget(self, worker_id: str) -> None:
        """A worker that stopped or restarted: its cache went with its process."""
        self._pages.pop(worker_id, None)

    def num_pages(self, worker_id: str) -> int:
        return len(self._pages.get(worker_id, ()))

    def cached_pages(self, worker_id: str, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, the worker holds (in either tier)."""
        pages = self._pages.get(worker_id)
        if not pages:
            return 0
        count = 0
        for content_hash in hashes:
            if content_hash not in pages:
                break
            count += 1
        return count


class PromptPages:
    """A prompt's full pages' hashes, computed on first use for each salt and page size (one per weights
    generation a request could be routed to)."""

    def __init__(self, token_ids: list[int], cache_salt: str):
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._hashes: dict[tuple[bytes, int], list[bytes]] = {}

    def hashes_for(self, ready: SchedulerReady) -> list[bytes]:
        # The engine computes at most the pages before the last token (one token is always left to compute).
        key = (model_salt(ready.model_name, ready.generation), ready.page_size)
        if key not in self._hashes:
            reusable = self.token_ids[: len(self.token_ids) - 1]
            self._hashes[key] = PageHasher(ready.page_size, key[0]).hash_tokens(reusable, self.cache_salt)
        return self._hashes[key]

    def cached_tokens(self, index: PrefixIndex, worker_id: str, ready: SchedulerReady) -> int:
        return index.cached_pages(worker_id, self.hashes_for(ready)) * ready.page_size
