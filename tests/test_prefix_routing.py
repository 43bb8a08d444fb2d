"""Prefix-aware routing: the frontend's index of each worker's pages, kept from their KV events, and the routing
key that weighs a worker's projected wait against the prefill of what of a prompt is not cached there."""

from __future__ import annotations

import msgspec
import pytest
from link_fixtures import MODEL, ready_link, report_load
from page_pool_fixtures import make_seq

from frontend.prefix_index import PrefixIndex, PromptPages
from frontend.scheduler_link import SchedulerLink
from gpu_runtime.ipc.messages import KVEvents, LoadReport, ToFrontend
from gpu_runtime.kv_cache.kv_events import (
    DEVICE_MEDIUM,
    HOST_MEDIUM,
    AllPagesCleared,
    KVEventLog,
    PagesRemoved,
    PagesStored,
)
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_cache.page_hashes import model_salt

PAGE = 16
SYSTEM = list(range(1000, 1000 + 8 * PAGE))  # a shared system prompt of eight pages


@pytest.fixture
def link():
    made = ready_link(2)
    for state in made.schedulers:
        load(state, running=0, projected_ttft=0.0)
    yield made
    made.close()


def load(state, running: int, projected_ttft: float) -> None:
    """A load report of a worker whose step-time model prices a prompt token at 1 ms."""
    report_load(state, running, projected_ttft)
    state.load = msgspec.structs.replace(state.load, seconds_per_token=0.001)


def cache_on(link: SchedulerLink, worker: int, tokens: list[int], cache_salt: str = "") -> None:
    """What a worker's KV events say once it computed `tokens`: its full pages, hashed as its engine does."""
    state = link.schedulers[worker]
    manager = KVCacheManager(64, PAGE, salt=model_salt(state.ready.model_name, state.ready.generation))
    events = manager.report_events()
    seq = make_seq("s", tokens + [7], cache_salt=cache_salt)
    manager.hash_new_pages(seq)
    assert manager.try_admit(seq, manager.find_cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    manager.commit_full_pages(seq)
    link.workers.prefix_index.apply(KVEvents(state.address.worker_id, "1", events.take()))


def pick(link: SchedulerLink, tokens: list[int], cache_salt: str = "") -> int:
    chosen = link.workers.pick(MODEL, prompt=PromptPages(tokens, cache_salt))
    return link.schedulers.index(chosen)


def test_the_frontend_hashes_a_prompt_as_the_worker_hashed_its_pages(link):
    prompt = SYSTEM + [5, 6, 7]
    cache_on(link, 1, SYSTEM)
    assert PromptPages(prompt, "").cached_tokens(link.workers.prefix_index, "llama/1", link.schedulers[1].ready) == 128
    assert PromptPages(prompt, "tenant-b").cached_tokens(link.workers.prefix_index, "llama/1",
                                                         link.schedulers[1].ready) == 0  # fmt: skip


def test_a_prompt_goes_where_its_prefix_is_cached(link):
    cache_on(link, 1, SYSTEM)
    assert pick(link, SYSTEM + [5, 6, 7]) == 1
    assert pick(link, [9] * 140) == 0  # a cold prompt: the load alone (equal here), then the first worker


def test_another_salt_or_another_generation_does_not_count_as_cached(link):
    cache_on(link, 1, SYSTEM, cache_salt="tenant-a")
    load(link.schedulers[1], running=1, projected_ttft=0.01)  # a little busier: a tie is not the reason
    assert pick(link, SYSTEM + [5], cache_salt="tenant-b") == 0
    assert pick(link, SYSTEM + [5], cache_salt="tenant-a") == 1
    rolled = link.schedulers[1]
    rolled.ready = msgspec.structs.replace(rolled.ready, generation="v2")  # the same worker id on new weights
    assert pick(link, SYSTEM + [5], cache_salt="tenant-a") == 0


def test_the_load_term_caps_a_hot_prefix(link):
    """A hot prefix cached on one worker: the prompts go there while its queue costs less than the 128-token
    prefill elsewhere (0.128 s here), and to the other worker once its queue costs more."""
    cache_on(link, 0, SYSTEM)
    hot, other = link.schedulers
    load(hot, running=4, projected_ttft=0.05)
    assert pick(link, SYSTEM + [1, 2]) == 0
    load(hot, running=8, projected_ttft=0.5)
    assert pick(link, SYSTEM + [1, 2]) == 1


def test_requests_in_flight_more_than_half_a_batch_uneven_route_by_load_alone(link):
    """Five requests sent to the worker holding the pages since its last report, none to the other: their projected
    waits (66 ms against 1 ms) still favour the cached worker over a 128-token prefill (128 ms), but the imbalance
    (more than twice, and more than half of an 8-request batch, over the other's) sends the next prompt to the idle
    worker, as SGLang's cache-aware router does; within it the pages decide again."""
    cache_on(link, 0, SYSTEM)
    hot, idle = link.schedulers
    load(hot, running=0, projected_ttft=0.01)
    for _ in range(4):
        hot.reserve()
    assert pick(link, SYSTEM + [1, 2]) == 0  # 4 more: half a batch, not over it
    hot.reserve()
    assert pick(link, SYSTEM + [1, 2]) == 1
    idle.reserve()
    idle.reserve()
    idle.reserve()
    assert pick(link, SYSTEM + [1, 2]) == 0  # 5 against 3: even enough for the pages to count


def test_with_weight_zero_routing_is_by_load_alone(link):
    cache_on(link, 1, SYSTEM)
    load(link.schedulers[1], running=1, projected_ttft=0.01)
    link.workers.prefix_weight = 0.0
    assert pick(link, SYSTEM + [5]) == 0


def test_a_lost_worker_s_pages_leave_the_index(link):
    cache_on(link, 1, SYSTEM)
    link._lose(link.schedulers[1], "gone")
    assert link.workers.prefix_index.num_pages("llama/1") == 0


def test_the_index_follows_stores_removals_tiers_clears_and_snapshots():
    index, a, b, c = PrefixIndex(), b"a" * 32, b"b" * 32, b"c" * 32
    index.apply(KVEvents("w", "1", [PagesStored([a, b, c], None, [], DEVICE_MEDIUM)]))
    assert index.cached_pages("w", [a, b, c]) == 3
    index.apply(KVEvents("w", "1", [PagesStored([b], a, [], HOST_MEDIUM), PagesRemoved([b], DEVICE_MEDIUM)]))
    assert index.cached_pages("w", [a, b, c]) == 3  # b went to the host tier: still cached there
    index.apply(KVEvents("w", "1", [PagesRemoved([b], HOST_MEDIUM)]))
    assert index.cached_pages("w", [a, b, c]) == 1  # a hit is a leading run
    index.apply(KVEvents("w", "1", [PagesStored([c], None, [], DEVICE_MEDIUM)], snapshot=True))
    assert index.cached_pages("w", [c]) == 1 and index.cached_pages("w", [a]) == 0
    index.apply(KVEvents("w", "1", [AllPagesCleared()]))
    assert index.num_pages("w") == 0


def test_the_event_log_batches_a_chain_and_its_removals_into_one_event_each():
    log = KVEventLog()
    log.stored(b"a", None, [1, 2], DEVICE_MEDIUM)
    log.stored(b"b", b"a", [3, 4], DEVICE_MEDIUM)
    log.stored(b"x", None, [9, 9], DEVICE_MEDIUM)  # another prompt's first page: a new event
    log.removed(b"a", DEVICE_MEDIUM)
    log.removed(b"b", DEVICE_MEDIUM)
    assert log.take() == [PagesStored([b"a", b"b"], None, [1, 2, 3, 4], DEVICE_MEDIUM),
                          PagesStored([b"x"], None, [9, 9], DEVICE_MEDIUM),
                          PagesRemoved([b"a", b"b"], DEVICE_MEDIUM)]  # fmt: skip
    assert log.take() == []


def test_kv_events_cross_the_worker_socket_as_plain_data():
    message = KVEvents("w", "1", [PagesStored([b"a" * 32], None, [1], HOST_MEDIUM), AllPagesCleared()], True)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=ToFrontend)
    assert decoded == message and not isinstance(decoded, LoadReport)
