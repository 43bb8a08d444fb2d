"""PageAllocator and KVCacheManager, case by case: the deterministic companions of the state machine in
test_page_allocator.py."""

from __future__ import annotations

import pytest
import torch
from page_pool_fixtures import SALT, chain_hashes, count_page_hashes, make_seq, tiny_pool

from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_cache.page_allocator import OutOfPagesError, PageAllocator
from gpu_runtime.kv_cache.page_hashes import PageHasher
from gpu_runtime.kv_cache.transfer import PageExport, import_pages
from gpu_runtime.sequence import Sequence


def _queued(kv: KVCacheManager, name: str, prompt: list[int], cache_salt: str = "") -> Sequence:
    """A new sequence with its full pages hashed, as Scheduler.add leaves it."""
    seq = make_seq(name, prompt, cache_salt=cache_salt)
    kv.hash_new_pages(seq)
    return seq


def _computed(
    kv: KVCacheManager, name: str, prompt: list[int], num_tokens: int | None = None, cache_salt: str = ""
) -> Sequence:
    """A sequence admitted (from whatever is cached) and computed up to `num_tokens` tokens, the scheduler's way."""
    seq = _queued(kv, name, prompt, cache_salt)
    num_tokens = len(prompt) if num_tokens is None else num_tokens
    match = kv.find_cached_prefix(seq)
    assert kv.try_admit(seq, match, num_tokens)
    seq.num_computed_tokens = num_tokens  # the scheduler sets it at admission and advances it after the step
    kv.hash_new_pages(seq)
    kv.commit_full_pages(seq)
    return seq


def test_pool_needs_at_least_one_page():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="num_pages"):
        KVCacheManager(0, 16)


def test_num_pages_for_rounds_up():
    manager = KVCacheManager(8, 16)
    assert [manager.num_pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert manager.fits_pool(8 * 16, max_chunk=16)
    assert not manager.fits_pool(8 * 16 + 1, max_chunk=16)


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


def test_rejected_free_changes_nothing():
    allocator = PageAllocator(4)
    a, b = allocator.allocate(2)
    allocator.register(a, b"h")
    allocator.free([b])
    with pytest.raises(ValueError):
        allocator.free([a, b])  # b is already free
    assert allocator.ref_count(a) == 1 and allocator.num_free_pages == 3
    assert allocator.lookup(b"h") == a and not allocator.is_evictable(a)


def test_release_then_reserve_again():
    manager = KVCacheManager(4, 4)
    seq = make_seq("a")
    assert manager.try_reserve(seq, 16)  # all four pages
    assert not manager.try_reserve(make_seq("b"), 1)
    seq.num_computed_tokens = 16
    manager.release(seq)
    assert seq.page_ids == [] and seq.num_registered_pages == 0
    assert seq.num_computed_tokens == 16  # how much is computed is the scheduler's to say, and to zero
    seq.num_computed_tokens = 0
    assert manager.num_free_pages == 4
    assert manager.try_reserve(seq, 5) and len(seq.page_ids) == 2


def test_a_failed_try_reserve_takes_no_page_even_when_some_are_free():
    kv = KVCacheManager(4, 2)
    seq = make_seq("a", list(range(9)))
    assert kv.try_reserve(seq, 3)  # two pages
    pages = list(seq.page_ids)
    assert not kv.try_reserve(seq, 9)  # three more needed, two free
    assert seq.page_ids == pages and kv.num_free_pages == 2
    assert kv.try_reserve(seq, 8) and len(seq.page_ids) == 4 and seq.page_ids[:2] == pages
    kv.check_integrity([seq])


def test_register_needs_an_owned_page_and_keeps_the_first_page_for_a_hash():
    allocator = PageAllocator(3)
    with pytest.raises(ValueError, match="free"):
        allocator.register(0, b"x")
    a, b = allocator.allocate(2)
    allocator.register(a, b"x")
    allocator.register(b, b"x")  # the same content computed twice: the first copy stays
    allocator.register(a, b"y")  # a page holds one content
    assert allocator.lookup(b"x") == a and allocator.hash_of(b) is None and allocator.lookup(b"y") is None
    allocator.free([a, b])
    assert allocator.is_evictable(a) and not allocator.is_evictable(b)
    assert allocator.num_free_pages == 3 and allocator.num_cached_pages == 1


def test_allocate_takes_empty_pages_first_then_evicts_the_least_recently_freed():
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    for i, page in enumerate(pages[:3]):
        allocator.register(page, bytes([i]))
    allocator.free([pages[1], pages[0], pages[2], pages[3]])  # cached in the order 1, 0, 2
    assert allocator.allocate(1) == [pages[3]]  # the empty one first
    assert allocator.num_evictions == 0
    allocator.share(pages[1])  # revived: no longer evictable, keeps its content
    allocator.free([pages[1]])  # now the most recently freed
    assert allocator.allocate(2) == [pages[0], pages[2]]
    assert allocator.num_evictions == 2
    assert allocator.lookup(bytes([0])) is None and allocator.lookup(bytes([2])) is None
    assert allocator.lookup(bytes([1])) == pages[1]


def test_release_frees_the_tail_first_so_the_head_of_a_prefix_stays_cached():
    kv = KVCacheManager(4, 2)
    seq = _computed(kv, "a", [0, 1, 2, 3, 4, 5, 6], 6)  # three full pages, cached when freed
    kv.release(seq)
    assert kv.num_free_pages == 4 and kv.allocator.num_cached_pages == 3
    hog = kv.allocator.allocate(2)  # the empty page, then one eviction: the last page of the prefix
    assert kv.allocator.num_evictions == 1
    match = kv.find_cached_prefix(_queued(kv, "b", [0, 1, 2, 3, 4, 5, 6]))
    assert match.num_tokens(2) == 4
    kv.allocator.free(hog)


def test_find_cached_prefix_leaves_a_token_to_compute_and_respects_salts_and_caching_off():
    kv = KVCacheManager(8, 2, salt=b"m1")
    prompt = [1, 2, 3, 4, 5]
    seq = _computed(kv, "a", prompt, 4)
    assert kv.find_cached_prefix(_queued(kv, "b", prompt)).page_ids == seq.page_ids[:2]
    # A prompt whose every page is cached still computes its last page: that step yields the next token.
    assert kv.find_cached_prefix(_queued(kv, "c", [1, 2, 3, 4])).page_ids == seq.page_ids[:1]
    assert kv.find_cached_prefix(_queued(kv, "d", [1, 2])).page_ids == []
    assert kv.lookup(seq.page_hashes).page_ids == seq.page_ids[:2]  # by hashes alone, no such limit
    assert kv.find_cached_prefix(_queued(kv, "e", [1, 2, 9, 9, 9])).page_ids == seq.page_ids[:1]
    # A later page never matches without its parents.
    assert kv.find_cached_prefix(_queued(kv, "f", [9, 2, 3, 4, 5])).page_ids == []
    other = KVCacheManager(8, 2, salt=b"m2")
    for page, h in zip(other.allocator.allocate(2), seq.page_hashes, strict=True):
        other.allocator.register(page, h)
    assert other.find_cached_prefix(_queued(other, "g", prompt)).page_ids == []  # another model's pages never match
    assert kv.find_cached_prefix(_queued(kv, "h", prompt, cache_salt="tenant-b")).page_ids == []
    off = KVCacheManager(8, 2, enable_prefix_caching=False)
    seq_off = _computed(off, "i", prompt, 4)
    assert seq_off.page_hashes == [] and off.allocator.num_cached_pages == 0
    assert off.find_cached_prefix(_queued(off, "j", prompt)).page_ids == []


def test_a_failed_try_admit_changes_nothing():
    kv = KVCacheManager(3, 2)
    first = _computed(kv, "a", [1, 2, 3, 4, 5], 4)
    kv.release(first)  # two cached pages, one empty
    hog = kv.allocator.allocate(1)  # the empty one
    seq = _queued(kv, "b", [1, 2, 3, 4, 7, 7, 7])
    hashes = list(seq.page_hashes)
    match = kv.find_cached_prefix(seq)
    assert len(match.page_ids) == 2
    assert not kv.try_admit(seq, match, 6)  # reviving two pages + one fresh: only two free
    assert (seq.page_ids, seq.page_hashes, seq.num_registered_pages, seq.num_computed_tokens) == ([], hashes, 0, 0)
    assert kv.num_free_pages == 2 and all(kv.allocator.is_evictable(p) for p in match.page_ids)
    assert kv.num_prefix_query_tokens == 5 and kv.num_prefix_hit_tokens == 0  # only "a" counted
    assert kv.try_admit(seq, match, 4)  # the cached prefix alone fits
    assert seq.page_ids == match.page_ids and seq.num_registered_pages == 2
    assert seq.num_computed_tokens == 0 == seq.num_cached_tokens  # the scheduler sets them, not the manager
    assert kv.num_prefix_query_tokens == 5 + 7 and kv.num_prefix_hit_tokens == 4
    assert kv.num_free_pages == 0
    kv.allocator.check_integrity([seq.page_ids, hog])


def test_import_keeps_the_already_cached_part_of_the_prefix_it_imports():
    """Regression (fixed in 470f139): making room for the missing pages once evicted the cached head."""
    kv = KVCacheManager(3, 1)
    pool = tiny_pool(3, 1)
    busy = make_seq("busy", [9, 9])
    assert kv.try_reserve(busy, 1)  # a running request holds one page
    tokens = [0, 1]
    chain = chain_hashes(tokens, 1, 2, salt=b"")
    head, other = kv.allocator.allocate(2)
    kv.allocator.register(head, chain[0])  # the prefix's first page is already cached here...
    kv.allocator.register(other, b"other content")
    kv.allocator.free([head, other])  # ...and is the oldest cached page, the first to be evicted
    keys = torch.ones(1, 2, 1, 1, 1, dtype=torch.float64)
    assert import_pages(kv, pool, PageExport(1, chain, keys, -keys)) == 1  # only the second page was new
    match = kv.lookup(kv.hasher.hash_tokens(tokens))
    assert match.page_ids[0] == head and len(match.page_ids) == 2, "the imported prefix is not found whole"
    assert kv.allocator.lookup(b"other content") is None  # room was made from another cached page
    kv.check_integrity([busy])


def test_an_import_that_does_not_fit_without_evicting_its_own_head_is_refused():
    kv = KVCacheManager(2, 1)
    pool = tiny_pool(2, 1)
    busy = make_seq("busy", [9, 9])
    assert kv.try_reserve(busy, 1)
    chain = chain_hashes([0, 1], 1, 2, salt=b"")
    (head,) = kv.allocator.allocate(1)
    kv.allocator.register(head, chain[0])
    kv.allocator.free([head])
    keys = torch.ones(1, 2, 1, 1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="pages"):
        import_pages(kv, pool, PageExport(1, chain, keys, -keys))
    assert kv.allocator.lookup(chain[0]) == head and kv.allocator.is_evictable(head)
    assert kv.num_free_pages == 1 and kv.allocator.num_cached_pages == 1
    kv.check_integrity([busy])


# -- page hashes: computed once per sequence, salted per cache group ------------------------------------------


@pytest.fixture
def page_hash_calls(monkeypatch) -> list[int]:
    return count_page_hashes(monkeypatch)


def test_page_hasher_chains_from_a_salted_first_page_and_extends_window_by_window():
    hasher = PageHasher(2, SALT)
    tokens = list(range(9))
    chain = chain_hashes(tokens, 2, 4, cache_salt="t")
    assert hasher.hash_tokens(tokens, "t") == chain
    hashes: list[bytes] = []
    for end in range(len(tokens) + 1):  # as a sequence grows: each call sees only the tokens not yet hashed
        assert hasher.extend(hashes, tokens[len(hashes) * 2 : end], "t") is hashes
    assert hashes == chain
    # Another salt changes the first page and, through the chain, every page after it.
    other = hasher.hash_tokens(tokens, "u")
    assert all(a != b for a, b in zip(chain, other, strict=True))
    # The separator keeps the model's salt and the cache salt apart.
    assert PageHasher(2, b"ab").hash_tokens(tokens, "c") != PageHasher(2, b"a").hash_tokens(tokens, "bc")


def test_a_growing_sequence_hashes_each_of_its_pages_once(page_hash_calls):
    kv = KVCacheManager(16, 4, salt=SALT)
    seq = _queued(kv, "a", list(range(10)))
    assert page_hash_calls[0] == 2 and seq.page_hashes == chain_hashes(list(range(10)), 4, 2)
    for token in range(20):
        seq.append_token(token, None)
        for _ in range(3):  # hashing again and again, as several steps would, costs nothing more
            kv.hash_new_pages(seq)
    tokens = seq.prompt_token_ids + seq.output_token_ids
    assert seq.page_hashes == chain_hashes(tokens, 4, 30 // 4)
    assert page_hash_calls[0] == 30 // 4


def test_page_hashes_survive_preemption_and_find_the_sequences_own_pages_again(page_hash_calls):
    kv = KVCacheManager(16, 2, salt=SALT)
    seq = _computed(kv, "a", [1, 2, 3, 4, 5, 6, 7], 7)
    seq.append_token(8, None)  # the sampled token fills the fourth page
    hashes, pages, calls = list(seq.page_hashes), list(seq.page_ids), page_hash_calls[0]
    kv.release(seq)  # preempted: the scheduler zeroes what is computed, the hashes stay
    seq.num_computed_tokens = 0
    assert seq.page_hashes == hashes
    kv.hash_new_pages(seq)  # requeued (Scheduler.add): only the page the sampled token filled is new
    assert seq.page_hashes[:3] == hashes and len(seq.page_hashes) == 4
    assert page_hash_calls[0] == calls + 1
    calls += 1
    match = kv.find_cached_prefix(seq)
    assert match.page_ids == pages[:3]  # its own three computed pages, found by the hashes it kept
    assert kv.try_admit(seq, match, seq.num_tokens)
    assert page_hash_calls[0] == calls, "re-admission hashed the prompt again"
    kv.check_integrity([seq])


def test_equal_cache_salts_share_pages_and_different_ones_never_do():
    kv = KVCacheManager(32, 2, salt=SALT)
    prompt = [5, 6, 7, 8, 9]
    first = _computed(kv, "a", prompt, cache_salt="tenant-a")
    same = _queued(kv, "b", prompt, cache_salt="tenant-a")
    assert kv.find_cached_prefix(same).page_ids == first.page_ids[:2]
    owners = [first]
    for name, salt in (("c", "tenant-b"), ("d", "")):
        assert kv.find_cached_prefix(_queued(kv, name, prompt, cache_salt=salt)).page_ids == [], (
            f"cache salt {salt!r} was served tenant-a's pages"
        )
        other = _computed(kv, name, prompt, cache_salt=salt)  # computes its own copy...
        assert not set(other.page_ids) & set(first.page_ids)
        # ...which its own cache group then shares.
        assert kv.find_cached_prefix(_queued(kv, name + "2", prompt, cache_salt=salt)).page_ids == other.page_ids[:2]
        owners.append(other)
    kv.check_integrity(owners)
