"""PageAllocator + KVCacheManager under random interleavings of allocate/share/free/try_reserve/release.

A reference model counts, for every page, how many holders own it; after every step the allocator's
reference counts, free list and totals must agree with it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_cache.page_allocator import OutOfPagesError, PageAllocator
from gpu_runtime.sampling_params import SamplingParams
from gpu_runtime.sequence import Sequence

NUM_SEQS = 3
NUM_RAW_HOLDERS = 3


def _seq(name: str) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(), max_model_len=1 << 20, eos_token_ids=frozenset())


def _snapshot(manager: KVCacheManager, seqs: list[Sequence]) -> tuple:
    allocator = manager.allocator
    return (
        list(allocator._free),
        [allocator.ref_count(p) for p in range(allocator.num_pages)],
        [list(s.page_ids) for s in seqs],
        [s.num_computed_tokens for s in seqs],
    )


class PagePoolMachine(RuleBasedStateMachine):
    """Sequences reserve through the manager; "raw holders" stand for other users of the allocator."""

    @initialize(num_pages=st.integers(1, 10), page_size=st.integers(1, 5))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.manager = KVCacheManager(num_pages, page_size)
        self.allocator = self.manager.allocator
        self.seqs = [_seq(f"s{i}") for i in range(NUM_SEQS)]
        self.raw: list[list[int]] = [[] for _ in range(NUM_RAW_HOLDERS)]

    # -- the reference model --------------------------------------------------------------------

    def _holders(self) -> list[list[int]]:
        return [s.page_ids for s in self.seqs] + self.raw

    def _expected_refs(self) -> Counter:
        return Counter(page for holder in self._holders() for page in holder)

    def _used_pages(self) -> list[int]:
        return sorted(self._expected_refs())

    # -- rules ------------------------------------------------------------------------------------

    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), n=st.integers(0, 12))
    def allocate(self, holder: int, n: int) -> None:
        before = _snapshot(self.manager, self.seqs)
        free_before = self.allocator.num_free_pages
        if n > free_before:
            assert not self.allocator.can_allocate(n)
            with pytest.raises(OutOfPagesError):
                self.allocator.allocate(n)
            assert _snapshot(self.manager, self.seqs) == before, "a failed allocate changed the pool"
            return
        assert self.allocator.can_allocate(n)
        in_use = set(self._used_pages())
        pages = self.allocator.allocate(n)
        assert len(pages) == n
        assert len(set(pages)) == n, f"allocate handed out a page twice: {pages}"
        assert not set(pages) & in_use, f"allocate handed out pages already in use: {set(pages) & in_use}"
        assert all(0 <= p < self.allocator.num_pages for p in pages)
        assert all(self.allocator.ref_count(p) == 1 for p in pages)
        assert self.allocator.num_free_pages == free_before - n
        self.raw[holder].extend(pages)

    @rule(holder=st.integers(0, NUM_SEQS + NUM_RAW_HOLDERS - 1), data=st.data())
    def share(self, holder: int, data) -> None:
        """Another owner takes a page already in use (a shared prefix); a holder never owns a page twice."""
        owned = set(self._holders()[holder])
        candidates = [p for p in self._used_pages() if p not in owned]
        if not candidates:
            return
        page = data.draw(st.sampled_from(candidates))
        refs = self.allocator.ref_count(page)
        self.allocator.share(page)
        assert self.allocator.ref_count(page) == refs + 1
        self._holders()[holder].append(page)

    @rule(data=st.data())
    def share_free_page_is_rejected(self, data) -> None:
        free = [p for p in range(self.allocator.num_pages) if p not in self._expected_refs()]
        if not free:
            return
        page = data.draw(st.sampled_from(free))
        before = _snapshot(self.manager, self.seqs)
        with pytest.raises(ValueError, match=str(page)):
            self.allocator.share(page)
        assert _snapshot(self.manager, self.seqs) == before

    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), data=st.data())
    def free(self, holder: int, data) -> None:
        pages = self.raw[holder]
        if not pages:
            return
        chosen = data.draw(st.lists(st.sampled_from(pages), unique=True, min_size=1))
        refs = {p: self.allocator.ref_count(p) for p in chosen}
        free_before = self.allocator.num_free_pages
        self.allocator.free(chosen)
        for p in chosen:
            assert self.allocator.ref_count(p) == refs[p] - 1
            pages.remove(p)
        assert self.allocator.num_free_pages == free_before + sum(1 for p in chosen if refs[p] == 1)

    @rule(data=st.data())
    def over_free_is_rejected(self, data) -> None:
        """Freeing a page nobody owns (its count is 0) raises ValueError and changes nothing."""
        free = [p for p in range(self.allocator.num_pages) if p not in self._expected_refs()]
        if not free:
            return
        page = data.draw(st.sampled_from(free))
        before = _snapshot(self.manager, self.seqs)
        with pytest.raises(ValueError, match=str(page)):
            self.allocator.free([page])
        assert _snapshot(self.manager, self.seqs) == before, "a rejected free changed the pool"

    @rule(index=st.integers(0, NUM_SEQS - 1), num_tokens=st.integers(0, 60))
    def try_reserve(self, index: int, num_tokens: int) -> None:
        seq = self.seqs[index]
        before = _snapshot(self.manager, self.seqs)
        old_pages = list(seq.page_ids)
        needed = self.manager.pages_for(num_tokens)
        missing = needed - len(old_pages)
        enough = missing <= self.allocator.num_free_pages
        ok = self.manager.try_reserve(seq, num_tokens)
        assert ok == enough, f"try_reserve said {ok} with {missing} pages missing, {self.allocator.num_free_pages} free"
        if not ok:
            assert _snapshot(self.manager, self.seqs) == before, "try_reserve returned False but changed the pool"
            return
        assert seq.page_ids[: len(old_pages)] == old_pages, "try_reserve rewrote pages the sequence already held"
        assert len(seq.page_ids) == max(needed, len(old_pages))
        assert len(seq.page_ids) * self.manager.page_size >= num_tokens
        for p in seq.page_ids[len(old_pages) :]:
            assert self.allocator.ref_count(p) == 1
        if missing <= 0:
            assert _snapshot(self.manager, self.seqs) == before

    @rule(index=st.integers(0, NUM_SEQS - 1), computed=st.integers(0, 30))
    def release(self, index: int, computed: int) -> None:
        seq = self.seqs[index]
        seq.num_computed_tokens = computed
        refs = Counter(self.allocator.ref_count(p) for p in seq.page_ids)
        free_before = self.allocator.num_free_pages
        owned = list(seq.page_ids)
        self.manager.release(seq)
        assert seq.page_ids == []
        assert seq.num_computed_tokens == 0
        assert self.allocator.num_free_pages == free_before + refs[1]
        for p in owned:
            # Pages still shared with another holder stay in use; the rest went back to the free list.
            assert self.allocator.ref_count(p) == self._expected_refs()[p]

    # -- invariants -------------------------------------------------------------------------------

    @invariant()
    def ref_counts_match_owners(self) -> None:
        expected = self._expected_refs()
        actual = {p: self.allocator.ref_count(p) for p in range(self.allocator.num_pages)}
        assert actual == {p: expected.get(p, 0) for p in range(self.allocator.num_pages)}

    @invariant()
    def free_list_is_exactly_the_unowned_pages(self) -> None:
        free_list = list(self.allocator._free)
        assert len(free_list) == len(set(free_list)), f"a page is on the free list twice: {free_list}"
        zero = {p for p in range(self.allocator.num_pages) if self.allocator.ref_count(p) == 0}
        assert set(free_list) == zero

    @invariant()
    def totals_add_up(self) -> None:
        a = self.allocator
        assert a.num_free_pages + a.num_used_pages == a.num_pages
        assert a.num_used_pages == len(self._expected_refs())
        assert self.manager.num_free_pages == a.num_free_pages
        assert self.manager.num_used_pages == a.num_used_pages
        assert self.manager.num_pages == a.num_pages

    @invariant()
    def no_holder_owns_a_page_twice(self) -> None:
        for holder in self._holders():
            assert len(holder) == len(set(holder)), f"a holder owns a page twice: {holder}"

    @invariant()
    def can_allocate_agrees_with_free_count(self) -> None:
        free = self.allocator.num_free_pages
        assert self.allocator.can_allocate(free)
        assert not self.allocator.can_allocate(free + 1)


PagePoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagePool = PagePoolMachine.TestCase


# -- deterministic cases --------------------------------------------------------------------------


def test_pool_needs_at_least_one_page():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="num_pages"):
        KVCacheManager(0, 16)


def test_pages_for_rounds_up():
    manager = KVCacheManager(8, 16)
    assert [manager.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert manager.fits_pool(8 * 16)
    assert not manager.fits_pool(8 * 16 + 1)


def test_freed_pages_are_reused_and_a_shared_page_survives_one_owner():
    allocator = PageAllocator(2)
    a, b = allocator.allocate(2)
    allocator.share(a)
    allocator.free([a])  # one owner left
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    allocator.free([a, b])
    assert sorted(allocator.allocate(2)) == [a, b]


def test_over_free_of_an_owned_page_raises():
    allocator = PageAllocator(3)
    (page,) = allocator.allocate(1)
    allocator.free([page])
    with pytest.raises(ValueError, match="freed more often than it was owned"):
        allocator.free([page])
    assert allocator.num_free_pages == 3


def test_release_then_reserve_again():
    manager = KVCacheManager(4, 4)
    seq = _seq("a")
    assert manager.try_reserve(seq, 16)  # all four pages
    assert not manager.try_reserve(_seq("b"), 1)
    seq.num_computed_tokens = 16
    manager.release(seq)
    assert seq.page_ids == [] and seq.num_computed_tokens == 0
    assert manager.num_free_pages == 4
    assert manager.try_reserve(seq, 5) and len(seq.page_ids) == 2


def test_rejected_free_changes_nothing():
    allocator = PageAllocator(4)
    a, b = allocator.allocate(2)
    allocator.free([b])
    with pytest.raises(ValueError):
        allocator.free([a, b])  # b is already free
    assert allocator.ref_count(a) == 1
    assert allocator.num_free_pages == 3
