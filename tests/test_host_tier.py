"""The host KV tier over a tiny real page pool: evicted prefix pages are kept in host memory and loaded back with
their content, under their salts only; and the page pool's state machine with the second tier (evict to host, load
back, host eviction, aborts and preemptions right after a load) never leaks, double-owns or mislabels a page."""

from __future__ import annotations

import zlib

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from page_pool_fixtures import SALT, make_seq, tiny_pool

from gpu_runtime.kv_cache.host_tier import HostPages, HostTier, KVCopy
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.sequence import Sequence

PAGE = 4


def content(seq: Sequence, position: int) -> float:
    """What a token's K/V holds here: a function of the cache salt and every token up to it, as a real model's
    K/V is a function of the prefix (exact in float64)."""
    prefix = seq.cache_salt.encode() + repr(seq.token_ids_range(0, position + 1)).encode()
    return float(zlib.crc32(prefix))


def tiered(num_pages: int, num_slots: int, keep_log: bool = False) -> KVCacheManager:
    pool = tiny_pool(num_pages, PAGE)
    tier = HostTier(num_slots, HostPages(pool, num_slots), keep_log=keep_log)
    manager = KVCacheManager(num_pages, PAGE, salt=SALT, host_tier=tier)
    manager.pool = pool  # for the tests' reads and writes
    return manager


def admit(manager: KVCacheManager, seq: Sequence) -> bool:
    manager.hash_new_pages(seq)
    match = manager.find_cached_prefix(seq)
    if not manager.try_admit(seq, match, seq.num_tokens):
        return False
    seq.num_computed_tokens = match.num_tokens(PAGE)
    return True


def compute(manager: KVCacheManager, seq: Sequence) -> None:
    """The prefill's writes of the tokens not cached, then the step's bookkeeping."""
    k, _ = manager.pool.layers[0]
    for position in range(seq.num_computed_tokens, seq.num_tokens):
        k[seq.page_ids[position // PAGE], position % PAGE] = content(seq, position)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit_full_pages(seq)


def assert_holds_its_prefix(manager: KVCacheManager, seq: Sequence) -> None:
    k, _ = manager.pool.layers[0]
    held = [k[seq.page_ids[p // PAGE], p % PAGE].item() for p in range(seq.num_computed_tokens)]
    assert held == [content(seq, p) for p in range(seq.num_computed_tokens)], seq.request_id


PROMPT_A = list(range(100, 117))  # four full pages and one token
PROMPT_B = list(range(200, 217))


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_its_content():
    manager = tiered(num_pages=5, num_slots=8)
    first = make_seq("a", PROMPT_A)
    assert admit(manager, first)
    compute(manager, first)
    manager.release(first)
    crowd = make_seq("b", PROMPT_B)  # takes every page: A's cached pages are evicted, to the host tier
    assert admit(manager, crowd)
    compute(manager, crowd)
    assert manager.host.num_offloaded == 4 and len(manager.host) == 4
    manager.release(crowd)
    again = make_seq("a2", PROMPT_A)
    assert admit(manager, again)
    assert again.num_computed_tokens == 16 and manager.num_host_hit_tokens == 16  # all four pages, from the host
    assert manager.host.num_loaded == 4
    assert_holds_its_prefix(manager, again)
    manager.check_integrity([again])


def test_another_salt_never_hits_the_host_tier():
    manager = tiered(num_pages=5, num_slots=8)
    first = make_seq("a", PROMPT_A, cache_salt="tenant-1")
    assert admit(manager, first)
    compute(manager, first)
    manager.release(first)
    crowd = make_seq("b", PROMPT_B)
    assert admit(manager, crowd)
    compute(manager, crowd)
    manager.release(crowd)
    other = make_seq("a-other", PROMPT_A, cache_salt="tenant-2")
    assert admit(manager, other)
    assert other.num_computed_tokens == 0 and manager.host.num_loaded == 0


def test_a_full_host_tier_drops_its_least_recently_used_pages():
    manager = tiered(num_pages=5, num_slots=4)
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("c", list(range(300, 317)))):
        seq = make_seq(name, prompt)
        assert admit(manager, seq)
        compute(manager, seq)
        manager.release(seq)
    # A's pages went to the host when B came, and were dropped for B's when C came.
    assert manager.host.num_offloaded == 8 and manager.host.num_dropped == 4
    assert admit(manager, seq := make_seq("b2", PROMPT_B)) and seq.num_computed_tokens == 16
    assert_holds_its_prefix(manager, seq)
    # Its own admission evicted C's pages with every host slot held for its load: C's are dropped, not B's.
    assert manager.host.num_dropped == 8 and manager.host.find(seq.page_hashes[0]) is not None
    manager.release(seq)
    assert admit(manager, seq := make_seq("a2", PROMPT_A)) and seq.num_computed_tokens == 0


def test_under_tensor_parallelism_the_copies_are_logged_in_order_for_the_other_ranks():
    manager = tiered(num_pages=5, num_slots=8, keep_log=True)
    rank = tiny_pool(5, PAGE)  # another rank's pool and host tier, kept equal by replaying the log
    rank_host = HostPages(rank, 8)
    for name, prompt in (("a", PROMPT_A), ("b", PROMPT_B), ("a2", PROMPT_A)):
        seq = make_seq(name, prompt)
        assert admit(manager, seq)
        rank_host.replay(manager.host.take_log())
        compute(manager, seq)
        rank.layers[0][0].copy_(manager.pool.layers[0][0])  # the forward writes alike on every rank
        manager.release(seq)
    log = [copy.to_host for copy in manager.host.take_log()]
    assert log == []  # taken with each step
    assert torch.equal(rank_host._pairs[0][2], manager.host.pages._pairs[0][2])


def test_the_tier_is_refused_naming_its_key_where_it_cannot_serve():
    with pytest.raises(ValueError, match="^kv_offload_bytes: "):
        HostTier(0)
    with pytest.raises(ValueError, match="^kv_offload_bytes: .*sliding-window"):
        KVCacheManager(8, PAGE, windows=(None, 8), host_tier=HostTier(4))


def test_a_copy_is_plain_data_for_the_rank_channel():
    import msgspec

    copies = [KVCopy(True, 3, 1), KVCopy(False, 2, 1)]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(copies), type=list[KVCopy]) == copies


BASES = [list(range(b * 50, b * 50 + 12)) for b in range(3)]  # three shared prefixes of three pages


class HostTierMachine(RuleBasedStateMachine):
    """Requests over three shared prefixes and two salts, admitted, computed, finished, aborted and preempted in a
    pool small enough that its cached pages keep going to the host tier and coming back. After every rule: the
    pool's and the tier's invariants; after every admission: each page the sequence starts from holds its prefix."""

    @initialize(num_pages=st.integers(4, 10), num_slots=st.integers(1, 12))
    def setup(self, num_pages: int, num_slots: int) -> None:
        self.manager = tiered(num_pages, num_slots)
        self.running: list[Sequence] = []
        self.count = 0

    @rule(base=st.integers(0, 2), tail=st.lists(st.integers(0, 9), max_size=6), salt=st.sampled_from(["", "t"]))
    def admit_a_request(self, base: int, tail: list[int], salt: str) -> None:
        self.count += 1
        seq = make_seq(f"r{self.count}", BASES[base] + tail, cache_salt=salt)
        if not self.manager.fits_pool(seq.num_tokens, seq.num_tokens):
            return
        if admit(self.manager, seq):
            assert_holds_its_prefix(self.manager, seq)
            self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), finish=st.booleans())
    def compute_and_maybe_finish(self, data, finish: bool) -> None:
        seq = data.draw(st.sampled_from(self.running))
        compute(self.manager, seq)
        if finish:
            self.running.remove(seq)
            self.manager.release(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort_or_preempt_before_its_step(self, data) -> None:
        """Right after its admission (its pages loaded from the host, none computed by a step yet)."""
        seq = data.draw(st.sampled_from(self.running))
        self.running.remove(seq)
        self.manager.release(seq)
        seq.num_computed_tokens = 0

    @invariant()
    def pages_and_slots_are_consistent(self) -> None:
        if hasattr(self, "manager"):
            self.manager.check_integrity(self.running)


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
