"""Maps sequences to pages: reserving them, sharing cached prefixes between requests, giving them back."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from gpu_runtime.kv_cache.page_allocator import PageAllocator
from gpu_runtime.sequence import Sequence


def page_hash(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    """The content hash of one full page: its tokens, everything before them (via `parent`), and the model.

    SHA-256 makes an accidental collision (which would serve another prompt's K/V) negligible, so a hit
    needs no token-by-token verification.
    """
    digest = hashlib.sha256(parent)
    digest.update(salt)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest run of a sequence's leading full pages already in the cache."""

    page_ids: list[int]
    hashes: list[bytes]

    def num_tokens(self, page_size: int) -> int:
        return len(self.page_ids) * page_size


class KVCacheManager:
    """The scheduler's view of the page pool; the K/V tensors themselves live in KVPool.

    With prefix caching on, every full page a sequence computes is registered under its chained content
    hash; a new sequence starts from the longest registered prefix of its tokens instead of recomputing it,
    and pages freed by finished sequences keep their content until an allocation needs them.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, salt: bytes = b""):
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of which found cached

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

    # -- admission ------------------------------------------------------------------------------------

    def find_cached_prefix(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """The cached pages holding the longest prefix of `token_ids` (at most `max_tokens`); changes nothing."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], [])
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        pages, hashes, parent = [], [], b""
        for index in range(limit // self.page_size):
            start = index * self.page_size
            content_hash = page_hash(parent, token_ids[start : start + self.page_size], self.salt)
            page = self.allocator.lookup(content_hash)
            if page is None:
                break
            pages.append(page)
            hashes.append(content_hash)
            parent = content_hash
        return PrefixMatch(pages, hashes)

    def try_admit(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> bool:
        """Gives `seq` its cached prefix plus fresh pages up to `num_tokens`; False (and no change) if short."""
        revived = sum(1 for page in match.page_ids if self.allocator.is_evictable(page))
        fresh = self.pages_for(num_tokens) - len(match.page_ids)
        if fresh + revived > self.allocator.num_free_pages:
            return False
        for page in match.page_ids:  # share first, so the allocation below cannot evict them
            self.allocator.share(page)
        seq.page_ids = match.page_ids + self.allocator.allocate(max(fresh, 0))
        seq.page_hashes = list(match.hashes)
        seq.num_computed_tokens = match.num_tokens(self.page_size)
        if seq.num_preemptions == 0:  # count each prompt once, not again on recompute
            seq.num_cached_tokens = seq.num_computed_tokens
            if self.enable_prefix_caching:
                self.num_prefix_query_tokens += seq.num_tokens
                self.num_prefix_hit_tokens += seq.num_computed_tokens
        return True

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s block table to cover `num_tokens` tokens; False (and no change) if pages lack."""
        missing = self.pages_for(num_tokens) - len(seq.page_ids)
        if missing <= 0:
            return True
        if not self.allocator.can_allocate(missing):
            return False
        seq.page_ids.extend(self.allocator.allocate(missing))
        return True

    # -- after a step -----------------------------------------------------------------------------------

    def commit_full_pages(self, seq: Sequence) -> None:
        """Registers every page `seq` has filled with computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.page_size
        parent = seq.page_hashes[-1] if seq.page_hashes else b""
        for index in range(len(seq.page_hashes), num_full):
            start = index * self.page_size
            parent = page_hash(parent, seq.token_ids_range(start, start + self.page_size), self.salt)
            seq.page_hashes.append(parent)
            self.allocator.register(seq.page_ids[index], parent)

    def release(self, seq: Sequence) -> None:
        """Returns every page of `seq`. Freed last page first, so a prefix's head stays cached longest."""
        self.allocator.free(seq.page_ids[::-1])
        seq.page_ids = []
        seq.page_hashes = []
        seq.num_computed_tokens = 0

    # -- checks -----------------------------------------------------------------------------------------

    def check_integrity(self, sequences: list[Sequence]) -> None:
        """Every page is free, cached or owned, and reference counts equal the owners (AssertionError if not)."""
        self.allocator.check_integrity([seq.page_ids for seq in sequences])
        for seq in sequences:
            assert len(seq.page_hashes) <= len(seq.page_ids), f"{seq.request_id} has hashes for pages it lacks"
            assert len(seq.page_ids) >= self.pages_for(seq.num_computed_tokens), f"{seq.request_id} lost pages"
