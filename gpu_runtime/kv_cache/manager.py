"""Maps sequences to pages: how many a length needs, reserving them, and giving them back."""

from __future__ import annotations

from gpu_runtime.kv_cache.page_allocator import PageAllocator
from gpu_runtime.sequence import Sequence


class KVCacheManager:
    """The scheduler's view of the page pool; the K/V tensors themselves live in KVPool."""

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_used_pages

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits_pool(self, num_tokens: int) -> bool:
        """Whether a sequence this long could ever be held, with the whole pool to itself."""
        return self.pages_for(num_tokens) <= self.allocator.num_pages

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s block table to cover `num_tokens` tokens; False (and no change) if pages lack."""
        missing = self.pages_for(num_tokens) - len(seq.page_ids)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing):
            return False
        seq.page_ids.extend(self.allocator.allocate(missing))
        return True

    def release(self, seq: Sequence) -> None:
        """Returns every page of `seq`; its cached tokens are gone."""
        self.allocator.free(seq.page_ids)
        seq.page_ids = []
        seq.num_computed_tokens = 0
