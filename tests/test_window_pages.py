"""Pages behind a sliding window: where every layer of the model slides (KVCacheManager.window), a sequence gives back
the pages no query of it will read again as it moves on, so it holds one window's pages plus the step's, whatever
its length; what it gives back stays in the prefix cache. Driven here as the scheduler drives the manager (reserve,
compute, hash, commit, release); the model-level check, tokens equal to transformers' while pages are given back, is
tests/test_model_families.py's."""

from __future__ import annotations

import grpc
import pytest
from page_pool_fixtures import SALT, make_seq

from frontend.errors import RequestError
from frontend.validation import prepare
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.kv_cache.manager import KVCacheManager, held_pages
from gpu_runtime.sequence import Sequence
from tokend.v1 import tokend_pb2 as pb

PAGE = 4
WINDOW = 10  # not a multiple of the page: the oldest visible page is partly out of the window
CHUNK = 8


def step(kv: KVCacheManager, seq: Sequence, num_new: int) -> None:
    """One scheduler step of `num_new` tokens for `seq`: pages reserved, tokens computed, pages committed."""
    assert kv.try_reserve(seq, seq.num_computed_tokens + num_new)
    seq.num_computed_tokens += num_new
    kv.hash_new_pages(seq)
    kv.commit_full_pages(seq)
    kv.release_behind_window(seq)


def run(kv: KVCacheManager, seq: Sequence, num_decodes: int, on_step=lambda: None) -> None:
    """Admits `seq`, prefills it in CHUNK-token chunks, then decodes `num_decodes` tokens (token id 7 each)."""
    match = kv.find_cached_prefix(seq)
    first = min(seq.num_tokens - match.num_tokens(PAGE), CHUNK)
    assert kv.try_admit(seq, match, match.num_tokens(PAGE) + first)
    seq.num_computed_tokens = match.num_tokens(PAGE)
    while seq.num_computed_tokens < seq.num_tokens:
        step(kv, seq, min(CHUNK, seq.num_tokens - seq.num_computed_tokens))
        on_step()
    for _ in range(num_decodes):
        seq.output_token_ids.append(7)
        step(kv, seq, 1)
        on_step()


def most_pages_held(window: int | None, page: int, chunk: int) -> int:
    """The pages a sequence may hold after a step: those of its window's oldest position onwards, plus the next
    step's chunk (the last page is never released)."""
    return -(-(window - 1 + chunk) // page) + 1


@pytest.mark.parametrize("caching", [True, False])
def test_a_long_sequence_holds_one_window_of_pages(caching):
    kv = KVCacheManager(64, PAGE, enable_prefix_caching=caching, salt=SALT, window=WINDOW)
    seq = make_seq("long", list(range(100)), max_tokens=60)
    held: list[int] = []

    def check():
        kv.check_integrity([seq])
        held.append(len(held_pages(seq)))
        # Every position the next query sees lies in a page the sequence still holds.
        first_visible = max(seq.num_computed_tokens - WINDOW + 1, 0)
        assert seq.num_released_pages <= first_visible // PAGE
        assert set(seq.page_ids) <= set(held_pages(seq))  # released entries name its own pages, no one else's

    run(kv, seq, num_decodes=60, on_step=check)
    assert max(held) <= most_pages_held(WINDOW, PAGE, CHUNK) < kv.num_pages_for(seq.num_tokens)
    assert held[-1] <= -(-WINDOW // PAGE) + 1  # decoding: one window, give or take the page being filled
    assert kv.num_used_pages == held[-1]
    kv.release(seq)
    kv.check_integrity([])
    assert kv.num_free_pages == kv.num_pages


def test_without_a_window_a_sequence_keeps_every_page():
    kv = KVCacheManager(64, PAGE, salt=SALT)
    seq = make_seq("long", list(range(100)), max_tokens=20)
    run(kv, seq, num_decodes=20)
    assert seq.num_released_pages == 0
    assert len(held_pages(seq)) == kv.num_pages_for(seq.num_computed_tokens)


def test_pages_given_back_stay_in_the_prefix_cache():
    kv = KVCacheManager(64, PAGE, salt=SALT, window=WINDOW)
    prompt = list(range(50))
    first = make_seq("first", prompt, max_tokens=4)
    run(kv, first, num_decodes=4)
    assert first.num_released_pages > 0
    again = make_seq("again", prompt, max_tokens=4)
    kv.hash_new_pages(again)
    # The whole prompt's full pages are found, the released ones too (all but the last token: its step samples).
    assert kv.find_cached_prefix(again).num_tokens(PAGE) == (len(prompt) - 1) // PAGE * PAGE
    run(kv, again, num_decodes=4)
    kv.check_integrity([first, again])


def test_a_preempted_sequence_starts_over_from_its_cached_prefix():
    kv = KVCacheManager(64, PAGE, salt=SALT, window=WINDOW)
    seq = make_seq("preempted", list(range(60)), max_tokens=10)
    run(kv, seq, num_decodes=5)
    kv.release(seq)  # the scheduler's preemption: every page it holds back, its computed tokens forgotten
    seq.num_computed_tokens = 0
    assert (seq.page_ids, seq.num_released_pages) == ([], 0)
    kv.check_integrity([seq])
    run(kv, seq, num_decodes=5)
    assert seq.num_cached_tokens == 0 and seq.num_released_pages > 0
    kv.check_integrity([seq])


def test_integrity_check_catches_a_page_released_inside_the_window():
    kv = KVCacheManager(64, PAGE, salt=SALT, window=WINDOW)
    seq = make_seq("long", list(range(40)), max_tokens=4)
    run(kv, seq, num_decodes=0)
    kv.check_integrity([seq])
    seq.num_released_pages += 1  # as if one more page had gone: one the next query still reads
    with pytest.raises(AssertionError):
        kv.check_integrity([seq])


def test_a_prefix_whose_head_was_evicted_is_found_by_its_window():
    """A windowed request needs only the pages its next query sees: a prefix whose first pages were evicted (given
    back first, they are the oldest in the cache) is still a hit, its head skipped instead of recomputed."""
    kv = KVCacheManager(20, PAGE, salt=SALT, window=WINDOW)
    prompt = list(range(60))  # 15 pages
    first = make_seq("first", prompt, max_tokens=1)
    run(kv, first, num_decodes=0)
    kv.release(first)
    others = kv.allocator.allocate(10)  # the 5 empty pages, then the 5 oldest cached: the prompt's head
    kv.allocator.free(others)
    again = make_seq("again", prompt, max_tokens=4)
    kv.hash_new_pages(again)
    assert kv.lookup(again.page_hashes).page_ids == []  # the head is gone: a whole-prefix lookup finds nothing
    match = kv.find_cached_prefix(again)
    assert match.num_tokens(PAGE) == 14 * PAGE  # every full page but the last token's (its step samples)
    assert match.num_skipped == (14 * PAGE - WINDOW + 1) // PAGE == 11  # from the next query's window on
    assert len(match.page_ids) == 3
    run(kv, again, num_decodes=4)
    assert again.num_computed_tokens == len(prompt) + 4 and again.num_released_pages > 11
    kv.check_integrity([again])


def test_with_a_window_a_request_longer_than_the_pool_fits():
    """Admission counts the pages a request holds at once: with a window, one window plus a step's chunk."""
    windowed, whole = KVCacheManager(8, PAGE, window=WINDOW), KVCacheManager(8, PAGE)
    assert windowed.most_pages_held(1000, max_chunk=CHUNK) == most_pages_held(WINDOW, PAGE, CHUNK) == 6
    assert windowed.fits_pool(1000, max_chunk=CHUNK) and not whole.fits_pool(1000, max_chunk=CHUNK)
    assert not windowed.fits_pool(1000, max_chunk=1000)  # a prompt computed whole holds all of its pages


def test_a_request_longer_than_the_pool_runs_to_its_end_in_it():
    kv = KVCacheManager(most_pages_held(WINDOW, PAGE, CHUNK), PAGE, salt=SALT, window=WINDOW)
    seq = make_seq("long", list(range(200)), max_tokens=100)
    assert kv.num_pages_for(300) > kv.num_pages * 10
    run(kv, seq, num_decodes=100, on_step=lambda: kv.check_integrity([seq]))
    assert seq.num_computed_tokens == 300


def scheduler_ready(window: int | None, max_prefill_chunk: int) -> SchedulerReady:
    """A scheduler of 8 pages of 4 tokens, as its hello tells the frontend."""
    return SchedulerReady("m/0", "1", 1, "m", "/m", "0", 4096, 258, 8, PAGE, 1, b"", kv_windows=[window],
                          max_prefill_chunk=max_prefill_chunk)  # fmt: skip


@pytest.mark.parametrize(
    ("window", "max_prefill_chunk", "pages"),
    [(WINDOW, CHUNK, None), (None, CHUNK, 250), (WINDOW, 0, 29)],  # None: accepted
)
def test_the_frontend_counts_a_requests_pages_as_the_engine_does(window, max_prefill_chunk, pages):
    """1,000 tokens (250 pages) against a pool of 8: a windowed model computing its prompt in chunks holds one window
    and a chunk (6 pages) and is served; without a window, or with the 100-token prompt computed whole, it is refused
    with INVALID_ARGUMENT naming the field and the pages it would need at once."""
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=900))
    ready, prompt = scheduler_ready(window, max_prefill_chunk), list(range(100))
    if pages is None:
        assert prepare(request, ready, prompt).sampling.max_tokens == 900
        return
    with pytest.raises(RequestError, match=rf"^sampling.max_tokens: .* need {pages} KV pages at once") as refused:
        prepare(request, ready, prompt)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
