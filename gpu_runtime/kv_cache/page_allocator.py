"""A fixed pool of KV pages handed out from a free list, each with a reference count."""

from __future__ import annotations

from collections import deque


class OutOfPagesError(RuntimeError):
    """Raised by allocate() when the pool cannot satisfy a request; callers check can_allocate first."""


class PageAllocator:
    """Owns page ids 0..num_pages-1. Invariant: a page is on the free list iff its reference count is 0."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages: the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._ref_counts = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if not self.can_allocate(num_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._ref_counts[page] = 1
        return pages

    def share(self, page: int) -> None:
        """Adds an owner to a page already in use (a shared prefix)."""
        if self._ref_counts[page] == 0:
            raise ValueError(f"page {page} is free and cannot be shared")
        self._ref_counts[page] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one owner from each page; a page nobody owns goes back to the free list.

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
                self._free.append(page)
