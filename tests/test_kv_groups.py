"""KV groups (gpu_runtime/kv_cache/kv_groups.py): a model that mixes sliding and global layers (Gemma 2 and 3) gets a
block table per group of layers, so its sliding layers give their pages back behind the window while its global
layers keep theirs, all from one pool. Driven here as the scheduler drives the manager (tests/test_window_pages.py's
`run`); the model-level check, tokens equal to transformers' with the pages measured from the pool, is
tests/test_model_families.py's."""

from __future__ import annotations

import grpc
import msgspec
import pytest
from page_pool_fixtures import SALT, make_seq
from test_window_pages import CHUNK, PAGE, WINDOW, most_pages_held, run, scheduler_ready

from common.lanes import Role
from frontend.errors import RequestError
from frontend.validation import prepare
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.kv_cache.kv_groups import KVLayout, kv_layout
from gpu_runtime.kv_cache.manager import KVCacheManager, held_pages
from gpu_runtime.worker.engine_start import engine_config_on_device
from gpu_runtime.worker.spec import WorkerSpec
from tokend.v1 import tokend_pb2 as pb

GEMMA3_270M = [None if (layer + 1) % 6 == 0 else 512 for layer in range(18)]  # 5 sliding to 1 global
# Three groups of two layers: the two global layers, then the four sliding ones in two.
WINDOWS = (None, WINDOW, WINDOW)


def test_gemma3_270m_is_six_groups_of_three_layers_with_the_global_group_first():
    layout = kv_layout(GEMMA3_270M)
    assert layout.windows == (None, 512, 512, 512, 512, 512)
    assert layout.groups[0].layers == (5, 11, 17)
    assert layout.layers_per_group == 3
    groups, slots = layout.group_of_layer(), layout.slot_of_layer()
    assert sorted(zip(groups, slots, strict=True)) == sorted(
        {(g, s) for g in range(6) for s in range(3)}
    )  # each place once


def test_gemma3_4b_is_seven_groups_of_five_the_last_of_four():
    """5 global and 29 sliding layers: groups the size of the rarest kind (vLLM's), not 34 groups of one layer."""
    layout = kv_layout([None if (layer + 1) % 6 == 0 else 1024 for layer in range(34)])
    assert [len(group.layers) for group in layout.groups] == [5, 5, 5, 5, 5, 5, 4]
    assert layout.windows == (None, *[1024] * 6) and layout.layers_per_group == 5
    assert sorted(layout.slot_of_layer()) == sorted([*range(5)] * 6 + [*range(4)])  # the last group's fifth unused


@pytest.mark.parametrize(
    ("windows", "expected"),
    [
        ([16, None, 16, None], (None, 16)),  # Gemma 2: alternating, two groups of two
        ([16, 16, 16], (16,)),  # every layer slides: one group with the window (Mistral 7B v0.1)
        ([None, None], (None,)),  # a global model
        ([8, 16, None, 16], (None, 8, 16, 16)),  # windows of two sizes: a group per size
    ],
)
def test_layers_are_grouped_by_how_far_they_read(windows, expected):
    assert kv_layout(windows).windows == expected


def test_without_hybrid_groups_every_layer_shares_one_table_that_keeps_every_page():
    """Hybrid groups off (a backend whose plan copies one block table, a prefill or decode worker: which ones is
    tests/test_model_families.py's) is one group, as a global model."""
    assert kv_layout(GEMMA3_270M, hybrid=False) == KVLayout.single(18)


def test_a_long_sequence_holds_its_global_pages_and_one_window_per_sliding_group():
    kv = KVCacheManager(256, PAGE, salt=SALT, windows=WINDOWS)
    seq = make_seq("long", list(range(100)), max_tokens=60)
    held: list[tuple[int, int]] = []  # (pages held, pages its global group holds) after each step

    def check():
        kv.check_integrity([seq])
        held.append((len(held_pages(seq)), len(seq.tables[0].page_ids)))
        assert seq.tables[0].num_released_pages == 0  # the global group's pages all stay

    run(kv, seq, num_decodes=60, on_step=check)
    window_pages = most_pages_held(WINDOW, PAGE, CHUNK)
    assert all(total <= global_pages + 2 * window_pages for total, global_pages in held)
    assert held[-1][0] < 2 * kv.num_pages_for(seq.num_tokens)  # against three tables of every page: 3 x 40
    assert kv.num_used_pages == held[-1][0]
    assert kv.most_pages_held(seq.num_tokens, CHUNK) == kv.num_pages_for(seq.num_tokens) + 2 * window_pages
    kv.release(seq)
    kv.check_integrity([])
    assert kv.num_free_pages == kv.num_pages


@pytest.mark.parametrize("keep", ["global", "sliding"])
def test_a_prefix_is_found_again_only_where_every_group_has_what_it_needs(keep):
    """Sent again, a prompt is a hit in every group (the sliding groups' released pages were cached too, and only
    their last window is needed). With the other groups' cached pages evicted, only the global group's pages, or
    only the sliding groups' windows, are not a hit."""
    kv = KVCacheManager(256, PAGE, salt=SALT, windows=WINDOWS)
    prompt = list(range(50))
    first = make_seq("first", prompt, max_tokens=4)
    run(kv, first, num_decodes=4)
    kv.release(first)
    again = make_seq("again", prompt, max_tokens=4)
    kv.hash_new_pages(again)
    match = kv.find_cached_prefix(again)
    assert match.num_tokens(PAGE) == (len(prompt) - 1) // PAGE * PAGE
    assert [group.num_skipped for group in match.groups] == [0, *[(48 - WINDOW + 1) // PAGE] * 2]
    kept = [page for group in (match.groups[:1] if keep == "global" else match.groups[1:]) for page in group.page_ids]
    for page in kept:
        kv.allocator.share(page)
    kv.allocator.evict_all_cached()  # every other cached page's content is gone
    kv.allocator.free(kept)
    assert kv.find_cached_prefix(again).num_pages == 0
    run(kv, again, num_decodes=4)  # computed again from the start
    kv.check_integrity([again])


def test_admission_counts_every_groups_pages_from_the_one_pool():
    """A prompt of 40 tokens asks 10 pages in each group: 30 fit a pool of 30 exactly, 29 do not."""
    for num_pages, admitted in ((30, True), (29, False)):
        kv = KVCacheManager(num_pages, PAGE, salt=SALT, windows=WINDOWS)
        seq = make_seq("p", list(range(40)))
        assert kv.try_admit(seq, kv.find_cached_prefix(seq), 40) is admitted
        assert kv.num_used_pages == (30 if admitted else 0)


def test_the_frontend_counts_a_hybrid_models_pages_as_the_engine_does():
    """1,000 tokens against a pool of 8 pages: the global group's 250 plus one window and a chunk (6) per sliding
    group, refused with INVALID_ARGUMENT naming the field and the engine's own count."""
    engine_count = KVCacheManager(8, PAGE, windows=WINDOWS).most_pages_held(1000, CHUNK)
    assert engine_count == 250 + 2 * 6
    ready = msgspec.structs.replace(scheduler_ready(None, CHUNK), kv_windows=list(WINDOWS))
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(max_tokens=900))
    refusal = rf"^sampling.max_tokens: .* need {engine_count} KV pages at once"
    with pytest.raises(RequestError, match=refusal) as refused:
        prepare(request, ready, list(range(100)))
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(("role", "hybrid"), [(Role.MIXED, True), (Role.PREFILL, False), (Role.DECODE, False)])
def test_prefill_and_decode_workers_keep_one_block_table_for_their_handover(role, hybrid):
    """The handover moves one block table's pages: a disaggregated worker's engine is started without KV groups."""
    spec = WorkerSpec(worker_id="m/0", group="cpu", input_address="", output_address="", heartbeat_path="",
                      secret_path="", engine=EngineConfig(device="cpu"), role=role)  # fmt: skip
    assert engine_config_on_device(spec).disable_hybrid_kv_cache_manager is not hybrid


def test_a_request_filling_the_context_is_capped_at_what_every_group_can_hold():
    """fill_context (the OpenAI chat default without max_tokens) on a hybrid model whose pool cannot hold a whole
    context: capped at the longest sequence whose pages in every group fit the pool, then served (before, it was
    capped at pages x page_size, which the sliding groups' share made too long, and refused)."""
    ready = msgspec.structs.replace(scheduler_ready(None, CHUNK), num_pages=40, kv_windows=list(WINDOWS))
    request = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(fill_context=True))
    prepared = prepare(request, ready, list(range(10)))
    longest = 10 + prepared.sampling.max_tokens
    kv = KVCacheManager(40, PAGE, windows=WINDOWS)
    assert kv.most_pages_held(longest, CHUNK) <= 40 < kv.most_pages_held(longest + PAGE, CHUNK)
    assert longest == (40 - 2 * 6) * PAGE  # the global group's pages: what the two windows leave
