"""CUDA-graph buckets for decode steps, on the CPU with the graph replaced by eager calls: which bucket a step
replays as, how it is padded (null-page rows that change no real sequence's output or pages), and which steps stay
eager."""

from __future__ import annotations

import pytest
import torch

from gpu_runtime.attention.backend import LayerAttentionOptions, make_attention_backend
from gpu_runtime.attention.decode_graph_buckets import (
    BucketedDecode,
    bucket_of,
    decode_graph_buckets,
    pad_decode_plan,
)
from gpu_runtime.attention.metadata import PlanRow
from gpu_runtime.step_inputs import StepPlan, inputs_of_plan

pytestmark = pytest.mark.fast

CPU = torch.device("cpu")
PAGE_SIZE, NULL_PAGE = 4, 0


def decode_plan(contexts: list[int], first_page: int = 1, num_static_padding: int = 0) -> StepPlan:
    """A decode-only step: sequence i has context contexts[i] on its own pages (after `first_page`); the last
    `num_static_padding` rows are a static batch's padding (attend, store nothing)."""
    rows, slots, page = [], [], first_page
    for i, context in enumerate(contexts):
        pages = list(range(page, page + -(-context // PAGE_SIZE)))
        page += len(pages)
        rows.append(PlanRow(i, 1, context, pages))
        if i < len(contexts) - num_static_padding:
            slots.append(pages[(context - 1) // PAGE_SIZE] * PAGE_SIZE + (context - 1) % PAGE_SIZE)
    num_real = len(contexts) - num_static_padding
    n = len(contexts)
    return StepPlan(list(range(3, 3 + n)), [c - 1 for c in contexts], slots, list(range(num_real)), rows, [], num_real)


def test_buckets_are_powers_of_two_to_16_then_multiples_of_16_up_to_max_num_seqs():
    assert decode_graph_buckets(1) == (1,)
    assert decode_graph_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_graph_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_graph_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert decode_graph_buckets(100)[-3:] == (80, 96, 100)
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_graph_buckets(0)


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    buckets = decode_graph_buckets(64)
    assert [bucket_of(n, buckets) for n in (0, 1, 3, 5, 16, 17, 33, 64, 65)] == [None, 1, 4, 8, 16, 32, 48, 64, None]


def test_padding_adds_null_page_rows_and_keeps_the_sampled_rows():
    plan = decode_plan([5, 9, 2])
    padded = pad_decode_plan(plan, 4, NULL_PAGE, PAGE_SIZE)
    assert len(padded.input_ids) == len(padded.positions) == len(padded.slots) == 4
    assert padded.decode_rows[:3] == plan.decode_rows
    assert padded.decode_rows[3] == PlanRow(3, 1, 1, [NULL_PAGE])
    assert padded.slots == plan.slots + [NULL_PAGE * PAGE_SIZE]
    assert padded.logits_rows == plan.logits_rows and padded.num_real_decodes == 3


def test_a_static_batchs_padding_rows_store_into_the_null_page_too():
    plan = decode_plan([5, 9, 6], num_static_padding=1)  # its third row attends but stores nothing
    padded = pad_decode_plan(plan, 4, NULL_PAGE, PAGE_SIZE)
    assert padded.slots == plan.slots + [NULL_PAGE * PAGE_SIZE] * 2
    assert padded.decode_rows[2] == plan.decode_rows[2]


def test_steps_with_prompt_chunks_or_past_the_bucket_are_refused_padding():
    mixed = StepPlan([1, 2, 3], [4, 0, 1], [5, 8, 9], [0, 2], [PlanRow(0, 1, 5, [1, 2])], [PlanRow(1, 2, 2, [3])], 1)
    with pytest.raises(ValueError, match="decode-only"):
        pad_decode_plan(mixed, 4, NULL_PAGE, PAGE_SIZE)
    with pytest.raises(ValueError, match="does not fit bucket 2"):
        pad_decode_plan(decode_plan([3, 3, 3]), 2, NULL_PAGE, PAGE_SIZE)


class Recorder:
    """Stands in for graph capture: each bucket's 'graph' is an eager call that records the plan it ran."""

    def __init__(self) -> None:
        self.captures: list[int] = []
        self.ran: list[tuple[str, int]] = []

    def capture(self, bucket: int):
        self.captures.append(bucket)
        return lambda plan: self.ran.append((f"graph-{bucket}", len(plan.input_ids)))

    def eager(self, plan: StepPlan):
        self.ran.append(("eager", len(plan.input_ids)))


def test_decode_steps_replay_their_bucket_captured_once_and_other_steps_run_eagerly():
    recorder = Recorder()
    runner = BucketedDecode(20, NULL_PAGE, PAGE_SIZE, recorder.capture, recorder.eager)
    mixed = StepPlan([1, 2], [4, 0], [5, 8], [0, 1], [PlanRow(0, 1, 5, [1, 2])], [PlanRow(1, 1, 1, [3])], 1)
    for plan in (decode_plan([3] * 3), decode_plan([7] * 4), mixed, decode_plan([2] * 17), decode_plan([4] * 3)):
        runner.run(plan)
    assert recorder.ran == [("graph-4", 4), ("graph-4", 4), ("eager", 2), ("graph-20", 20), ("graph-4", 4)]
    assert recorder.captures == [4, 20] and runner.captured_buckets == (4, 20)


def test_enforce_eager_runs_every_step_as_it_is():
    recorder = Recorder()
    runner = BucketedDecode(16, NULL_PAGE, PAGE_SIZE, recorder.capture, recorder.eager, enforce_eager=True)
    runner.run(decode_plan([3] * 3))
    assert recorder.ran == [("eager", 3)] and recorder.captures == []


@pytest.mark.parametrize("backend", ["torch", "batched"])
def test_padded_rows_change_no_real_sequences_output_or_pages(backend):
    """The same decodes, eager and padded to their bucket: the real rows' outputs are equal, and the padded run
    wrote nothing but the real new tokens and the null page."""
    plan = decode_plan([5, 9, 2, 7, 1], num_static_padding=1)
    padded = pad_decode_plan(plan, 8, NULL_PAGE, PAGE_SIZE)
    generator = torch.Generator().manual_seed(0)
    num_pages, kv_heads, group, dim = 12, 2, 2, 8
    pools = [torch.randn(num_pages, PAGE_SIZE, kv_heads, dim, generator=generator) for _ in range(2)]
    q = torch.randn(8, kv_heads * group, dim, generator=generator)
    k, v = (torch.randn(8, kv_heads, dim, generator=generator) for _ in range(2))
    options = LayerAttentionOptions.default(dim)
    results = []
    for step in (plan, padded):
        rows = len(step.input_ids)
        k_pages, v_pages = (pool.clone() for pool in pools)
        attention = make_attention_backend(backend, CPU)
        meta = inputs_of_plan(step, CPU).meta
        attention.plan(meta)
        out = attention.forward(q[:rows], k[:rows], v[:rows], k_pages, v_pages, meta, options)
        results.append((out, k_pages, v_pages))
    (eager_out, eager_k, eager_v), (padded_out, padded_k, padded_v) = results
    torch.testing.assert_close(padded_out[:5], eager_out, rtol=0, atol=0)
    assert torch.isfinite(padded_out).all()
    real_pages = slice(NULL_PAGE + 1, None)
    assert torch.equal(padded_k[real_pages], eager_k[real_pages])
    assert torch.equal(padded_v[real_pages], eager_v[real_pages])
