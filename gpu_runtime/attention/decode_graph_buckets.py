"""Which decode steps a CUDA graph replays, and how: batch-size buckets, and a decode-only step padded up to its
bucket with rows that write and read only a reserved null page.

A captured graph replays fixed shapes, so decode-only steps are captured once per bucket (1, 2, 4, 8, 16, then
multiples of 16 up to max_num_seqs) and a step of n decodes runs as the smallest bucket that holds it. Steps with
prompt chunks (their shapes vary with every chunk) and steps past the largest bucket run eagerly. Pure Python over
StepPlans: the capture is a callable given to BucketedDecode (torch.cuda.CUDAGraph capture and replay on a GPU; an
eager forward in the CPU tests). Not wired into the runner yet: the engine needs a null page that the allocator
never hands out, and fixed-width block tables for the captured shapes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Generic, TypeVar

from gpu_runtime.attention.metadata import PlanRow
from gpu_runtime.step_inputs import StepPlan

SMALL_BUCKETS = (1, 2, 4, 8, 16)
BUCKET_STEP = 16


def decode_graph_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, then every multiple of 16 below max_num_seqs, then max_num_seqs itself (a full batch never
    pads past the most sequences a step can hold)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, not {max_num_seqs}")
    small = [size for size in SMALL_BUCKETS if size < max_num_seqs]
    large = list(range(2 * BUCKET_STEP, max_num_seqs, BUCKET_STEP))
    return (*small, *large, max_num_seqs)


def bucket_of(num_seqs: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding `num_seqs` decode rows; None past the largest (or for an empty step)."""
    if num_seqs < 1:
        return None
    index = bisect.bisect_left(buckets, num_seqs)
    return buckets[index] if index < len(buckets) else None


def is_decode_only(plan: StepPlan) -> bool:
    """Every row of the step is a single-query decode row (real, or a static batch's padding): graph-shaped."""
    return not plan.prefill_rows and bool(plan.decode_rows)


def pad_decode_plan(plan: StepPlan, bucket: int, null_page: int, page_size: int) -> StepPlan:
    """`plan` (decode-only) with `bucket` rows: the added rows decode token 0 at position 0 with the null page as
    their whole one-token context. Every row past the real decodes (the added ones, and a static batch's padding)
    stores its K/V in the null page's first slot, so that the slot mapping has the bucket's length and no padding
    row writes into a sequence's page; only padding rows ever read the null page. The sampled rows are unchanged."""
    if not is_decode_only(plan):
        raise ValueError("only a decode-only step pads to a graph bucket: one with prompt chunks runs eagerly")
    num_rows = len(plan.decode_rows)
    if num_rows > bucket:
        raise ValueError(f"a step of {num_rows} decode rows does not fit bucket {bucket}")
    added = bucket - num_rows
    null_slot = null_page * page_size
    padding = [PlanRow(num_rows + i, 1, 1, [null_page]) for i in range(added)]
    return StepPlan(
        input_ids=plan.input_ids + [0] * added,
        positions=plan.positions + [0] * added,
        slots=plan.slots + [null_slot] * (bucket - len(plan.slots)),
        logits_rows=plan.logits_rows,
        decode_rows=plan.decode_rows + padding,
        prefill_rows=[],
        num_real_decodes=plan.num_real_decodes,
    )


Result = TypeVar("Result")


class BucketedDecode(Generic[Result]):
    """Runs each step either through its bucket's graph (captured at the bucket's first step) or eagerly.

    `capture(bucket)` returns the bucket's replay: a callable run with each padded plan of that size (on CUDA it
    copies the plan's inputs into the graph's persistent buffers and replays; in the tests it is an eager forward).
    `eager(plan)` runs a step as it is. With `enforce_eager`, every step is eager (--enforce-eager)."""

    def __init__(
        self,
        max_num_seqs: int,
        null_page: int,
        page_size: int,
        capture: Callable[[int], Callable[[StepPlan], Result]],
        eager: Callable[[StepPlan], Result],
        enforce_eager: bool = False,
    ) -> None:
        self.buckets = decode_graph_buckets(max_num_seqs)
        self._null_page, self._page_size = null_page, page_size
        self._capture, self._eager = capture, eager
        self._enforce_eager = enforce_eager
        self._replays: dict[int, Callable[[StepPlan], Result]] = {}

    @property
    def captured_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._replays))

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket this step replays as, or None where it runs eagerly."""
        if self._enforce_eager or not is_decode_only(plan):
            return None
        return bucket_of(len(plan.decode_rows), self.buckets)

    def run(self, plan: StepPlan) -> Result:
        bucket = self.bucket_for(plan)
        if bucket is None:
            return self._eager(plan)
        if bucket not in self._replays:
            self._replays[bucket] = self._capture(bucket)
        return self._replays[bucket](pad_decode_plan(plan, bucket, self._null_page, self._page_size))
