"""Maps sequences to pages: reserving them, sharing cached prefixes between requests, giving them back."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_runtime.kv_cache.host_tier import HostTier
from gpu_runtime.kv_cache.kv_events import DEVICE_MEDIUM, HOST_MEDIUM, KVEventLog
from gpu_runtime.kv_cache.page_allocator import PageAllocator
from gpu_runtime.kv_cache.page_budget import pages_held_at_most
from gpu_runtime.kv_cache.page_hashes import HASH_BYTES, PageHasher
from gpu_runtime.sequence import BlockTable, Sequence


@dataclass(frozen=True, slots=True)
class GroupMatch:
    """One KV group's cached pages for a prefix: with a window, those after its `num_skipped` first pages (behind the
    window of the prefix's next position: not needed, nor held)."""

    page_ids: list[int]
    num_skipped: int = 0


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached pages a sequence may start from: the longest run of its leading full pages whose pages every KV
    group needs are cached (all of them for a global group; with a window, those of the last window)."""

    num_pages: int  # leading pages of the sequence it covers
    groups: tuple[GroupMatch, ...]  # each group's device pages for them
    hashes: list[bytes]  # the first group's pages' hashes
    # Host-tier slots of the pages after the device ones (counted in num_pages): loaded back at admission.
    host_slots: list[int] = field(default_factory=list)

    @property
    def page_ids(self) -> list[int]:
        """The first group's pages (every layer's, unless the model is hybrid)."""
        return self.groups[0].page_ids

    @property
    def num_skipped(self) -> int:
        return self.groups[0].num_skipped

    def num_tokens(self, page_size: int) -> int:
        return self.num_pages * page_size


class KVCacheManager:
    """The scheduler's view of the page pool; the K/V tensors themselves live in KVPool.

    With prefix caching on, each sequence's page hashes are computed once, as its pages fill (hash_new_pages);
    every full page it computes is registered under its hash, a new sequence starts from the longest
    registered prefix of its tokens instead of recomputing it, and pages freed by finished sequences keep
    their content until an allocation needs them. The manager writes a sequence's block tables (page_ids,
    num_registered_pages); how many of its tokens are computed is the scheduler's to say.

    A group with a `window` (its layers attend over their last `window` positions only: every layer of Mistral 7B
    v0.1 and Phi-3-mini-4k, the sliding layers of Gemma 2 and 3) never reads a page again once its tokens have all
    left the window: release_behind_window gives it back as the sequence moves on, so a long sequence holds one
    window's pages in that group (plus the step's), not its whole length. `windows` has one entry per KV group
    (gpu_runtime/kv_cache/kv_groups.py), each group's block table drawn from the one pool; one group by default.

    With a `host_tier` (one group without a window: --kv-offload-bytes), a cached page evicted from the pool is kept
    in host memory, and a prefix that goes on past the device's cached pages goes on in the host tier: those pages
    are loaded into fresh pages at admission and count as cached (gpu_runtime/kv_cache/host_tier.py).
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        enable_prefix_caching: bool = True,
        salt: bytes = b"",
        window: int | None = None,
        windows: tuple[int | None, ...] | None = None,
        host_tier: HostTier | None = None,
    ):
        self.page_size = page_size
        self.windows = windows if windows is not None else (window,)
        self.allocator = PageAllocator(num_pages)
        if host_tier is not None and self.windows != (None,):
            raise ValueError("kv_offload_bytes: the host tier keeps the pages of models whose layers all attend "
                             "globally (one block table); this one has sliding-window layers")  # fmt: skip
        self.host = host_tier
        self.allocator.on_evict = self._evicted
        self.events: KVEventLog | None = None  # what the prefix cache gains and loses, once report_events() asked
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = PageHasher(page_size, salt)
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hit_tokens = 0  # of which found cached
        self.num_host_hit_tokens = 0  # of which found in the host tier

    def report_events(self) -> KVEventLog:
        """From now on, every page the prefix cache (or its host tier) gains or loses is an event in the log."""
        self.events = KVEventLog()
        if self.host is not None:
            self.host.events = self.events
        return self.events

    def cached_hashes(self) -> dict[str, list[bytes]]:
        """Every prompt page cached now, per medium (kv_events): what a frontend that says hello is told."""
        cached = {DEVICE_MEDIUM: [key for key in self.allocator.cached_hashes() if len(key) == HASH_BYTES]}
        if self.host is not None:
            cached[HOST_MEDIUM] = self.host.cached_hashes()
        return cached

    def _evicted(self, page: int, key: bytes) -> None:
        """An allocation evicts a cached page: it leaves the index (a first group's page: the others' are never
        named), and goes to the host tier if there is one."""
        if self.events is not None and len(key) == HASH_BYTES:
            self.events.removed(key, DEVICE_MEDIUM)
        if self.host is not None:
            self.host.offload(page, key)

    def register_page(self, page: int, content_hash: bytes, group: int = 0, parent: bytes | None = None,
                      token_ids: list[int] = ()) -> None:  # fmt: skip
        """Files an owned, full page of `group` under its content hash (kept as is where that content is cached
        already); a first group's page is an event too, with its parent's hash and its tokens where known."""
        stored = self.allocator.register(page, self._key(content_hash, group))
        if stored and group == 0 and self.events is not None:
            self.events.stored(content_hash, parent, list(token_ids), DEVICE_MEDIUM)

    @property
    def window(self) -> int | None:
        """The window of a model whose layers all slide (one group); None otherwise."""
        return self.windows[0] if len(self.windows) == 1 else None

    @property
    def num_groups(self) -> int:
        return len(self.windows)

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
        """The most pages a sequence of `num_tokens` holds at once, its groups' together: all of its pages in a global
        group, and in a windowed one those from its window's oldest position to the end of a step's chunk (admission
        included: find_cached_prefix skips the pages behind the window)."""
        return pages_held_at_most(num_tokens, self.page_size, self.windows, max_chunk)

    # -- hashing --------------------------------------------------------------------------------------

    def hash_new_pages(self, seq: Sequence) -> None:
        """Hashes the pages of `seq` that filled since the last call (each page once in the sequence's life)."""
        if not self.enable_prefix_caching:
            return
        first_unhashed = len(seq.page_hashes) * self.page_size
        if seq.num_tokens - first_unhashed >= self.page_size:
            window = seq.token_ids_range(first_unhashed, seq.num_tokens)
            self.hasher.extend(seq.page_hashes, window, seq.cache_salt)

    def _key(self, content_hash: bytes, group: int) -> bytes:
        """The prefix cache's key for a page of `group` holding that content (the first group's: the hash itself, the
        one pages handed between workers are named by)."""
        return content_hash if group == 0 else content_hash + group.to_bytes(2, "little")

    # -- admission ------------------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> PrefixMatch:
        """The cached pages holding the longest prefix of `seq` it may reuse (Sequence.num_reusable_tokens: at least
        one token is left to compute, whose step yields the next token's logits); changes nothing. With a window,
        only the pages the next query sees must be cached (the ones behind it are evicted first, being older)."""
        hashes = seq.page_hashes[: seq.num_reusable_tokens // self.page_size]
        if not self.enable_prefix_caching:
            return self._match(0, [[] for _ in self.windows], [])
        if self.windows == (None,):
            return self._with_host_pages(self.lookup(hashes), hashes)
        pages = [[self.allocator.lookup(self._key(h, group)) for h in hashes] for group in range(self.num_groups)]
        best = 0  # the longest prefix (in pages) whose needed pages every group has cached
        runs = [0] * self.num_groups  # per group, the cached pages ending at the current one
        for end in range(1, len(hashes) + 1):
            for group, group_pages in enumerate(pages):
                runs[group] = runs[group] + 1 if group_pages[end - 1] is not None else 0
            if all(run >= self._pages_needed(end, window) for run, window in zip(runs, self.windows, strict=True)):
                best = end
        return self._match(best, pages, hashes)

    def _with_host_pages(self, match: PrefixMatch, hashes: list[bytes]) -> PrefixMatch:
        """`match` extended by the host tier's run of the pages after it."""
        slots = self.host.run_of(hashes[match.num_pages :]) if self.host is not None else []
        if not slots:
            return match
        num_pages = match.num_pages + len(slots)
        return PrefixMatch(num_pages, match.groups, hashes[:num_pages], slots)

    def _pages_needed(self, num_pages: int, window: int | None) -> int:
        """The last pages of a `num_pages`-page prefix a group must have cached to continue from it: all of them,
        or with a window those its next query sees (at least one)."""
        if window is None:
            return num_pages
        return max(num_pages - self._first_visible_page(num_pages * self.page_size, window), 1)

    def _match(self, num_pages: int, pages: list[list[int | None]], hashes: list[bytes]) -> PrefixMatch:
        groups = []
        for group_pages, window in zip(pages, self.windows, strict=True):
            skipped = self._first_visible_page(num_pages * self.page_size, window) if window and num_pages else 0
            groups.append(GroupMatch(group_pages[skipped:num_pages], skipped))
        return PrefixMatch(num_pages, tuple(groups), hashes[groups[0].num_skipped : num_pages])

    def _first_visible_page(self, position: int, window: int) -> int:
        """The page holding the oldest position a query at `position` sees (with a window)."""
        return max(position - window + 1, 0) // self.page_size

    def lookup(self, hashes: list[bytes]) -> PrefixMatch:
        """The cached pages of the longest leading run of `hashes`, as a KV handover or a migration moves them: one
        block table's, so none where the model's layers are split into groups (their prompt is computed again where
        it goes); changes nothing."""
        pages = []
        for content_hash in hashes if self.enable_prefix_caching and self.num_groups == 1 else []:
            page = self.allocator.lookup(content_hash)
            if page is None:
                break
            pages.append(page)
        return PrefixMatch(len(pages), (GroupMatch(pages),), hashes[: len(pages)])

    def try_admit(self, seq: Sequence, match: PrefixMatch, num_tokens: int) -> bool:
        """Gives `seq` its cached prefix plus fresh pages up to `num_tokens`, in every group; False (and no change) if
        short."""
        assert len(match.groups) == self.num_groups, "a match from find_cached_prefix (lookup's is the first group's)"
        needed = 0
        for group in match.groups:
            revived = sum(1 for page in group.page_ids if self.allocator.is_evictable(page))
            needed += revived + self._fresh_pages(group, num_tokens)
        if needed > self.allocator.num_free_pages:
            return False
        for group in match.groups:  # share first, so the allocations below cannot evict them
            for page in group.page_ids:
                self.allocator.share(page)
        if match.host_slots:
            self.host.hold(match.host_slots)  # nor the host pages the allocations' own evictions go to
        try:
            seq.tables = [self._admitted_table(group, match.num_pages, num_tokens) for group in match.groups]
            if match.host_slots:
                self._load_from_host(seq, seq.tables[0], match)
        finally:
            if match.host_slots:
                self.host.release(match.host_slots)
        if seq.num_preemptions == 0 and self.enable_prefix_caching:  # count each prompt once, not on recompute
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += match.num_tokens(self.page_size)
            self.num_host_hit_tokens += len(match.host_slots) * self.page_size
        return True

    def _load_from_host(self, seq: Sequence, table: BlockTable, match: PrefixMatch) -> None:
        """The host tier's pages of `match` into the fresh pages after the device ones, registered as cached (a hash
        already cached on the device stays that page's: the copy is then this sequence's alone)."""
        first = len(match.groups[0].page_ids)
        pages = table.page_ids[first : first + len(match.host_slots)]
        self.host.load(pages, match.host_slots)
        for index, page in enumerate(pages, start=first):
            self._register_seq_page(seq, page, index, 0)

    def _fresh_pages(self, group: GroupMatch, num_tokens: int) -> int:
        """The pages a group's table needs beyond its cached and skipped ones to cover `num_tokens`."""
        return max(self.num_pages_for(num_tokens) - group.num_skipped - len(group.page_ids), 0)

    def _admitted_table(self, group: GroupMatch, num_cached_pages: int, num_tokens: int) -> BlockTable:
        held = group.page_ids + self.allocator.allocate(self._fresh_pages(group, num_tokens))
        # Skipped entries name a page it holds, as released ones do.
        return BlockTable(held[:1] * group.num_skipped + held, num_cached_pages, group.num_skipped)

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s block tables to cover `num_tokens` tokens; False (and no change) if pages lack."""
        wanted = self.num_pages_for(num_tokens)
        missing = [max(wanted - len(table.page_ids), 0) for table in seq.tables]
        if not self.allocator.can_allocate(sum(missing)):
            return False
        for table, count in zip(seq.tables, missing, strict=True):
            table.page_ids.extend(self.allocator.allocate(count))
        return True

    # -- after a step -----------------------------------------------------------------------------------

    def commit_full_pages(self, seq: Sequence) -> None:
        """Registers every page `seq` has filled with computed tokens since the last call, in every group."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.page_size, len(seq.page_hashes))
        for group, table in enumerate(seq.tables):
            for index in range(table.num_registered_pages, num_full):
                self._register_seq_page(seq, table.page_ids[index], index, group)
            table.num_registered_pages = max(table.num_registered_pages, num_full)

    def _register_seq_page(self, seq: Sequence, page: int, index: int, group: int) -> None:
        """register_page for the `index`-th page of `seq`, its parent and tokens from the sequence."""
        parent = seq.page_hashes[index - 1] if index else None
        tokens = (
            seq.token_ids_range(index * self.page_size, (index + 1) * self.page_size) if self.events is not None else ()
        )
        self.register_page(page, seq.page_hashes[index], group, parent, tokens)

    def release_behind_window(self, seq: Sequence) -> None:
        """Gives back the pages of `seq` that no query of it will read again: in a group with a window, those whose
        tokens all lie before the window of its next position (num_computed_tokens). Call it after
        commit_full_pages: a released full page goes to the prefix cache, as a finished sequence's pages do."""
        for table, window in zip(seq.tables, self.windows, strict=True):
            if window is None:
                continue
            # The pages before the one the next query's window starts in; never the last (its successor may not be
            # reserved yet).
            behind = min(self._first_visible_page(seq.num_computed_tokens, window), len(table.page_ids) - 1)
            if behind <= table.num_released_pages:
                continue
            self.allocator.free(table.page_ids[table.num_released_pages : behind])
            table.page_ids[:behind] = [table.page_ids[behind]] * behind  # every released entry names a held page
            table.num_released_pages = behind

    def release(self, seq: Sequence) -> None:
        """Returns every page `seq` holds. Freed last position first, every group's page at a position together, so
        a prefix's head stays cached longest in every group (a hit needs each group's pages for it)."""
        held = [(index, page) for table in seq.tables for index, page in enumerate(table.page_ids)
                if index >= table.num_released_pages]  # fmt: skip
        self.allocator.free([page for _, page in sorted(held, key=lambda item: -item[0])])
        seq.tables = [BlockTable() for _ in seq.tables]

    # -- checks -----------------------------------------------------------------------------------------

    def check_integrity(self, sequences: list[Sequence], pinned: list[list[int]] = ()) -> None:
        """Every page is free, cached or owned, and reference counts equal the owners: the sequences' tables, and
        `pinned` page lists (leases) (AssertionError if not)."""
        owners = [table_pages_held(table) for seq in sequences for table in seq.tables]
        self.allocator.check_integrity(owners + list(pinned))
        if self.host is not None:
            self.host.check_integrity()
        for seq in sequences:
            holds = any(table.page_ids for table in seq.tables)
            assert len(seq.tables) == self.num_groups or not holds, f"{seq.request_id}: {len(seq.tables)} tables"
            held = [page for table in seq.tables for page in table_pages_held(table)]
            assert len(set(held)) == len(held), f"{seq.request_id} holds a page twice (in two groups?)"
            for group, (table, window) in enumerate(zip(seq.tables, self.windows, strict=False)):
                self._check_table(seq, table, window)
                for index in range(table.num_released_pages, table.num_registered_pages):
                    key = self.allocator.hash_of(table.page_ids[index])  # None: the content was cached elsewhere
                    assert key in (None, self._key(seq.page_hashes[index], group)), f"{seq.request_id}: mis-hashed"
            assert len(seq.page_hashes) <= seq.num_tokens // self.page_size, f"{seq.request_id} hashed a partial page"

    def _check_table(self, seq: Sequence, table: BlockTable, window: int | None) -> None:
        name = seq.request_id
        assert table.num_registered_pages <= len(table.page_ids), f"{name} registered pages it lacks"
        assert table.num_released_pages <= max(len(table.page_ids) - 1, 0), f"{name} released every page"
        if table.num_released_pages:
            assert window is not None, f"{name} released pages without a window"
            visible = self._first_visible_page(seq.num_computed_tokens, window)
            assert table.num_released_pages <= visible, f"{name} released a visible page"
        assert len(table.page_ids) >= self.num_pages_for(seq.num_computed_tokens), f"{name} lost pages"


def held_pages(seq: Sequence) -> list[int]:
    """The pages `seq` owns, in every group: each block table past the pages it released behind its window."""
    return [page for table in seq.tables for page in table_pages_held(table)]


def table_pages_held(table: BlockTable) -> list[int]:
    return table.page_ids[table.num_released_pages :]
