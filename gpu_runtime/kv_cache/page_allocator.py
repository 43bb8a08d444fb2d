"""A fixed pool of KV pages: reference counts, a free list, and an LRU of free pages that keep cached content."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class OutOfPagesError(RuntimeError):
    """Raised by allocate() when the pool cannot satisfy a request; callers check can_allocate first."""


class PageAllocator:
    """Owns page ids 0..num_pages-1.

    Every page is in exactly one of three states:
      - owned: reference count > 0 (held by one or more sequences);
      - free and empty: reference count 0, on `_free`, no content worth keeping;
      - free and cached: reference count 0, in `_evictable` (least recently freed first), still holding
        the K/V of a full page whose content hash is registered, so a later request can revive it.
    Allocation takes empty pages first and evicts cached ones (oldest first) only when none is left.
    """

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages: the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_pages
        self._hash_of_page: dict[int, bytes] = {}
        self._page_of_hash: dict[bytes, int] = {}
        self.num_evictions = 0
        # Called with (page, hash) as allocation evicts a cached page, before the page is handed out to be written:
        # the host tier's copy (gpu_runtime/kv_cache/host_tier.py).
        self.on_evict: Callable[[int, bytes], None] | None = None

    # -- counts -----------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take: empty ones plus cached ones it may evict."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages whose content is registered under a hash, owned or not."""
        return len(self._hash_of_page)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    # -- owning pages -------------------------------------------------------------------------------

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {self.num_free_pages} free")
        pages = [self._take_free_page() for _ in range(num_pages)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def _take_free_page(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._evictable.popitem(last=False)
        try:
            if self.on_evict is not None:
                self.on_evict(page, self._hash_of_page[page])
        except BaseException:
            self._evictable[page] = None  # still free and cached: as it was
            self._evictable.move_to_end(page, last=False)
            raise
        self._forget_hash(page)
        self.num_evictions += 1
        return page

    def share(self, page: int) -> None:
        """Adds an owner to a page: one in use (a shared prefix), or a cached free page it revives."""
        if self._ref_counts[page] == 0:
            if page not in self._evictable:
                raise ValueError(f"page {page} is free and holds nothing to share")
            del self._evictable[page]
        self._ref_counts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one owner from each page, in order; a page nobody owns becomes free, cached if hashed.

        All or nothing: an over-free anywhere in `pages` raises before any page changes.
        """
        drops: dict[int, int] = {}
        for page in pages:
            drops[page] = drops.get(page, 0) + 1
        for page, count in drops.items():
            if self._ref_counts[page] < count:
                raise ValueError(f"page {page} freed more often than it was owned")
        for page in pages:
            self._ref_counts[page] -= 1
            if self._ref_counts[page] == 0:
                if page in self._hash_of_page:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    # -- content hashes -----------------------------------------------------------------------------

    def register(self, page: int, content_hash: bytes) -> bool:
        """Records that an owned, full page holds the content `content_hash` names; False if it was cached already."""
        if self._ref_counts[page] == 0:
            raise ValueError(f"page {page} is free; only an owned page can be registered")
        if content_hash in self._page_of_hash or page in self._hash_of_page:
            return False  # the same content already cached elsewhere (computed twice at once); keep the first
        self._hash_of_page[page] = content_hash
        self._page_of_hash[content_hash] = page
        return True

    def lookup(self, content_hash: bytes) -> int | None:
        return self._page_of_hash.get(content_hash)

    def cached_hashes(self) -> list[bytes]:
        """Every registered content hash, owned or free."""
        return list(self._page_of_hash)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of_page.get(page)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def _forget_hash(self, page: int) -> None:
        content_hash = self._hash_of_page.pop(page, None)
        if content_hash is not None:
            del self._page_of_hash[content_hash]

    def evict_all_cached(self) -> int:
        """Drops every free cached page's content (it becomes empty); returns how many were dropped."""
        dropped = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            self._forget_hash(page)
            self._free.append(page)
        return dropped

    # -- integrity ----------------------------------------------------------------------------------

    def check_integrity(self, owners: list[list[int]]) -> None:
        """Asserts every invariant against the page lists of all owners; raises AssertionError if broken."""
        expected = [0] * self.num_pages
        for pages in owners:
            for page in pages:
                expected[page] += 1
        assert expected == self._ref_counts, "reference counts differ from the owners' page lists"
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free) and not free & evictable, "a page is listed free twice"
        for page in range(self.num_pages):
            owned = expected[page] > 0
            assert owned != (page in free or page in evictable), f"page {page} is both owned and free, or neither"
            assert (page in evictable) <= (page in self._hash_of_page), f"evictable page {page} has no hash"
            assert (page in free) <= (page not in self._hash_of_page), f"empty free page {page} has a hash"
        assert all(self._page_of_hash[h] == p for p, h in self._hash_of_page.items()), "hash maps disagree"
        assert len(self._page_of_hash) == len(self._hash_of_page), "hash maps disagree in size"
