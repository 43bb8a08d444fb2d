"""A prefill worker's leases: pages pinned for a decode worker stay out of every other sequence's reach until
released or expired, a lease being read cannot expire under its reader, the integrity check counts them, and only
the holder of a lease's token can read or unlock it, each of its pages once."""

from __future__ import annotations

from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.sequence import Sequence

PROMPT = list(range(1, 11))  # two full pages of 4, and a partial one


def _computed_and_finished(kv: KVCacheManager) -> None:
    """A request computed PROMPT and ended: its full pages are cached and free."""
    seq = Sequence("r", list(PROMPT), SamplingParams(max_tokens=1), max_model_len=64, eos_token_ids=frozenset())
    kv.hash_new_pages(seq)
    assert kv.try_admit(seq, kv.find_cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_full_pages(seq)
    kv.release(seq)


def test_a_lease_pins_the_prompts_full_pages_until_released():
    kv = KVCacheManager(num_pages=4, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    pages, hashes = leases.grant("r", PROMPT, "", seconds=30)
    assert len(pages) == 2 and hashes == kv.hasher.hash_tokens(PROMPT)
    assert kv.num_used_pages == 2 and len(leases) == 1
    kv.check_integrity([], leases.page_lists())
    assert not kv.allocator.can_allocate(3)  # only the two unleased pages can be handed out
    assert leases.release("r") and not leases.release("r")
    assert kv.num_used_pages == 0 and kv.lookup(hashes).page_ids == pages  # still cached, now evictable
    kv.check_integrity([], leases.page_lists())


def test_leases_expire_but_never_while_a_reader_copies_them():
    kv = KVCacheManager(num_pages=4, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    pages, _ = leases.grant("r", PROMPT, "", seconds=5)
    token = leases.token_of("r")
    assert leases.begin_read("r", pages, token) == ""
    assert "being pulled" in leases.begin_read("r", pages, token)
    assert leases.expire(now=1e12) == [] and len(leases) == 1  # being read: it waits for its reader
    assert leases.end_read("r", token) == ""
    assert leases.expire(now=1e12) == ["r"] and kv.num_used_pages == 0
    assert "unknown" in leases.begin_read("r", pages, token)


def test_a_pull_of_pages_the_lease_does_not_hold_is_refused():
    kv = KVCacheManager(num_pages=4, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    pages, _ = leases.grant("r", PROMPT, "", seconds=5)
    other = next(page for page in range(4) if page not in pages)
    assert f"page {other} is not held" in leases.begin_read("r", [pages[0], other], leases.token_of("r"))
    assert leases.grant("short", [1, 2], "", seconds=5) == ([], [])  # no full page: nothing to lease
    assert leases.token_of("short") == b""


def test_each_lease_has_its_own_unguessable_token():
    kv = KVCacheManager(num_pages=8, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    leases.grant("a", PROMPT, "", seconds=5)
    leases.grant("b", PROMPT, "", seconds=5)  # the same pages, shared: another lease, another token
    assert len(leases.token_of("a")) == 32 and leases.token_of("a") != leases.token_of("b")


def test_a_read_or_unlock_without_the_leases_token_is_refused_and_leaves_it_untouched():
    kv = KVCacheManager(num_pages=4, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    pages, _ = leases.grant("r", PROMPT, "", seconds=5)
    token = leases.token_of("r")
    for wrong in (b"", b"\0" * 32, token[:-1] + bytes([token[-1] ^ 1]), token + b"x"):
        assert "refused: its token is missing or wrong" in leases.begin_read("r", pages, wrong)
        assert not leases.is_being_read("r")  # not pinned by the refused reader
    assert leases.begin_read("r", pages, token) == ""
    assert "token is missing or wrong" in leases.end_read("r", b"")
    assert leases.is_being_read("r")  # a forged unlock does not cut the genuine read short
    assert leases.end_read("r", token) == "" and not leases.is_being_read("r")
    assert len(leases) == 1 and kv.num_used_pages == 2


def test_a_pull_naming_a_page_twice_or_none_is_refused():
    """A list of one page id repeated would make a 20 KB request return hundreds of MiB: each page once."""
    kv = KVCacheManager(num_pages=4, page_size=4)
    _computed_and_finished(kv)
    leases = KVLeases(kv)
    pages, _ = leases.grant("r", PROMPT, "", seconds=5)
    token = leases.token_of("r")
    assert "names a page more than once" in leases.begin_read("r", [pages[0]] * 5000, token)
    assert "names a page more than once" in leases.begin_read("r", [pages[0], pages[1], pages[0]], token)
    assert "names no page" in leases.begin_read("r", [], token)
    assert not leases.is_being_read("r")
    assert leases.begin_read("r", pages, token) == ""
