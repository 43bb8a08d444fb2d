"""Maps sequences to pages: reserving them, sharing cached prefixes between requests, giving them back."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.kv_cache.page_allocator import PageAllocator
from gpu_runtime.kv_cache.page_budget import pages_held_at_most
from gpu_runtime.kv_cache.page_hashes import PageHasher
from gpu_runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached pages a sequence may start from: the longest run of its leading full pages in the cache or, with a
    window, the longest prefix whose last window is cached: its `num_skipped` first pages, behind that window, are
    not needed (nor held)."""

    page_ids: list[int]  # the pages after the skipped ones, in order
    hashes: list[bytes]  # theirs
    num_skipped: int = 0

    def num_tokens(self, page_size: int) -> int:
        return (self.num_skipped + len(self.page_ids)) * page_size


class KVCacheManager:
    """The scheduler's view of the page pool; the K/V tensors themselves live in KVPool.

    With prefix caching on, each sequence's page hashes are computed once, as its pages fill (hash_new_pages);
    every full page it computes is registered under its hash, a new sequence starts from the longest
    registered prefix of its tokens instead of recomputing it, and pages freed by finished sequences keep
    their content until an allocation needs them. The manager writes a sequence's block table (page_ids,
    num_registered_pages); how many of its tokens are computed is the scheduler's to say.

    With a `window` (every layer of the model attends over its last `window` positions only: Mistral 7B v0.1,
    Phi-3-mini-4k) a page whose tokens have all left the window is never read again: release_behind_window gives
    it back as the sequence moves on, so a long sequence holds one window's pages (plus the step's), not its whole
    length. A model with any full-attention layer has no window here: every page stays until the sequence ends.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        window: int | None = None,
    ):
        self.page_size = page_size
        self.window = window
        self.allocator = PageAllocator(num_pages)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = PageHasher(page_size, salt)
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

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def fits_pool(self, num_tokens: int, max_chunk: int) -> bool:
        """Whether a sequence this long, computed at most `max_chunk` tokens a step, could ever be held with the whole
        pool to itself."""
        return self.most_pages_held(num_tokens, max_chunk) <= self.allocator.num_pages

    def most_pages_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most pages a sequence of `num_tokens` holds at once: all of them, or with a window the pages from its
        window's oldest position to the end of a step's chunk (admission included: find_cached_prefix skips the
        pages behind the window)."""
        return pages_held_at_most(num_tokens, self.page_size, self.window, max_chunk)

    # -- hashing --------------------------------------------------------------------------------------

    def hash_new_pages(self, seq: Sequence) -> None:
        """Hashes the pages of `seq` that filled since the last call (each page once in the sequence's life)."""
        if not self.enable_prefix_caching:
            return
        first_unhashed = len(seq.page_hashes) * self.page_size
        if seq.num_tokens - first_unhashed >= self.page_size:
            window = seq.token_ids_range(first_unhashed, seq.num_tokens)
            self.hasher.extend(seq.page_hashes, window, seq.cache_salt)

    # -- admission ------------------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached pages holding the longest prefix of `seq` it may reuse (Sequence.num_reusable_tokens: at least
        one token is left to compute, whose step yields the next token's logits); changes nothing. With a window,
        only the pages the next query sees must be cached (the ones behind it are evicted first, being older)."""
        hashes = seq.page_hashes[: seq.num_reusable_tokens // self.page_size]
        if self.window is None or not self.enable_prefix_caching:
            return self.lookup(hashes)
        return self._lookup_window(hashes)

    def _lookup_window(self, hashes: list[bytes]) -> PrefixMatch:
        """The longest leading run of `hashes` whose pages from its window's oldest position on are all cached (a
        page's hash chains every token before it, so a cached page is this very prefix's)."""
        pages = [self.allocator.lookup(content_hash) for content_hash in hashes]
        best = run = 0  # the longest usable prefix in pages; the cached pages ending at the current one
        for end, page in enumerate(pages, start=1):
            run = run + 1 if page is not None else 0
            if run >= max(end - self._first_visible_page(end * self.page_size), 1):
                best = end
        first = self._first_visible_page(best * self.page_size) if best else 0
        return PrefixMatch(pages[first:best], hashes[first:best], num_skipped=first)

    def _first_visible_page(self, position: int) -> int:
        """The page holding the oldest position a query at `position` sees (with a window)."""
        return max(position - self.window + 1, 0) // self.page_size

    def lookup(self, hashes: list[bytes]) -> PrefixMatch:
        """The cached pages of the longest leading run of `hashes`; changes nothing."""
        if not self.enable_prefix_caching:
            return PrefixMatch([], [])
        pages = []
        for content_hash in hashes:
            page = self.allocator.lookup(content_hash)
            if page is None:
                break
            pages.append(page)
        return PrefixMatch(pages, hashes[: len(pages)])

    def try_admit(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> bool:
        """Gives `seq` its cached prefix plus fresh pages up to `num_tokens`; False (and no change) if short."""
        revived = sum(1 for page in match.page_ids if self.allocator.is_evictable(page))
        fresh = self.num_pages_for(num_tokens) - match.num_skipped - len(match.page_ids)
        if fresh + revived > self.allocator.num_free_pages:
            return False
        for page in match.page_ids:  # share first, so the allocation below cannot evict them
            self.allocator.share(page)
        held = match.page_ids + self.allocator.allocate(max(fresh, 0))
        seq.page_ids = held[:1] * match.num_skipped + held  # skipped entries name a page it holds, as released ones
        seq.num_released_pages = match.num_skipped
        seq.num_registered_pages = match.num_skipped + len(match.page_ids)
        if seq.num_preemptions == 0 and self.enable_prefix_caching:  # count each prompt once, not on recompute
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += match.num_tokens(self.page_size)
        return True

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s block table to cover `num_tokens` tokens; False (and no change) if pages lack."""
        missing = self.num_pages_for(num_tokens) - len(seq.page_ids)
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
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.page_hashes))
        for index in range(seq.num_registered_pages, num_full):
            self.allocator.register(seq.page_ids[index], seq.page_hashes[index])
        seq.num_registered_pages = max(seq.num_registered_pages, num_full)

    def release_behind_window(self, seq: Sequence) -> None:
        """Gives back the pages of `seq` that no query of it will read again: with a window, those whose tokens all
        lie before the window of its next position (num_computed_tokens). Call it after commit_full_pages: a
        released full page goes to the prefix cache, as a finished sequence's pages do."""
        if self.window is None:
            return
        # The pages before the one the next query's window starts in; never the last (its successor may not be
        # reserved yet).
        behind = min(self._first_visible_page(seq.num_computed_tokens), len(seq.page_ids) - 1)
        if behind <= seq.num_released_pages:
            return
        released = seq.page_ids[seq.num_released_pages : behind]
        self.allocator.free(released)
        seq.page_ids[:behind] = [seq.page_ids[behind]] * behind  # every released entry names a page it holds
        seq.num_released_pages = behind

    def release(self, seq: Sequence) -> None:
        """Returns every page `seq` holds. Freed last page first, so a prefix's head stays cached longest."""
        self.allocator.free(held_pages(seq)[::-1])
        seq.page_ids = []
        seq.num_registered_pages = 0
        seq.num_released_pages = 0

    # -- checks -----------------------------------------------------------------------------------------

    def check_integrity(self, sequences: list[Sequence], pinned: list[list[int]] = ()) -> None:
        """Every page is free, cached or owned, and reference counts equal the owners: the sequences, and `pinned`
        page lists (leases) (AssertionError if not)."""
        self.allocator.check_integrity([held_pages(seq) for seq in sequences] + list(pinned))
        for seq in sequences:
            assert seq.num_registered_pages <= len(seq.page_ids), f"{seq.request_id} registered pages it lacks"
            assert seq.num_released_pages <= max(len(seq.page_ids) - 1, 0), f"{seq.request_id} released every page"
            if seq.num_released_pages:
                assert self.window is not None, f"{seq.request_id} released pages without a window"
                visible = self._first_visible_page(seq.num_computed_tokens)
                assert seq.num_released_pages <= visible, f"{seq.request_id} released a visible page"
            assert len(seq.page_ids) >= self.num_pages_for(seq.num_computed_tokens), f"{seq.request_id} lost pages"
            assert len(seq.page_hashes) <= seq.num_tokens // self.page_size, f"{seq.request_id} hashed a partial page"


def held_pages(seq: Sequence) -> list[int]:
    """The pages `seq` owns: its block table past the pages it released behind its window."""
    return seq.page_ids[seq.num_released_pages :]
