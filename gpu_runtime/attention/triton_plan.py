"""The Triton backend's per-step plan: the int32 tables its kernels read, in persistent device buffers, and the
launch shapes (split-KV partitions, prefill query blocks), derived once per step from the step's metadata.

Torch only (no triton): the arithmetic here is tested without a kernel. The buffers keep their device memory from
step to step (they grow, never shrink), so a step writes its tables into the same addresses as the last one: no
allocation per step, and the fixed addresses a captured CUDA graph needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_runtime.attention.metadata import AttentionMetadata, PlanRow


@dataclass(frozen=True, slots=True)
class TritonTuning:
    """Tile sizes and the split-KV policy. The defaults suit a datacenter GPU; tests shrink them so that tiny
    shapes still meet several tiles and partitions."""

    decode_block_n: int = 32  # keys per decode tile
    prefill_block_m: int = 64  # rows (queries x the query heads of a KV head) per prefill program
    prefill_block_n: int = 64  # keys per prefill tile
    min_partition: int = 256  # fewest keys per split-KV partition: shorter ones cost more to combine than they save
    max_partitions: int = 64  # most partitions per sequence (the combine holds them all at once)
    num_sms: int = 132  # streaming multiprocessors to fill (the device's own, where it has them)


def decode_partition_size(span: int, num_seqs: int, num_kv_heads: int, tuning: TritonTuning) -> int:
    """Keys per split-KV partition for a decode batch whose longest attended span is `span` tokens: enough
    partitions that the (sequence, KV head, partition) programs fill every SM about twice (batch 1 at long context
    then uses the whole GPU), none shorter than min_partition, at most max_partitions, a whole number of tiles."""
    wanted = -(-2 * tuning.num_sms // max(1, num_seqs * num_kv_heads))
    num_parts = max(1, min(wanted, tuning.max_partitions))
    size = max(-(-span // num_parts), tuning.min_partition, 1)
    size = -(-size // tuning.decode_block_n) * tuning.decode_block_n
    # Rounding up may still leave more partitions than allowed when min_partition is small: widen until not.
    while -(-span // size) > tuning.max_partitions:
        size += tuning.decode_block_n
    return size


def prefill_programs(rows: tuple[PlanRow, ...], block_q: int) -> list[int]:
    """Flat (chunk index, first query) pairs, one per block of `block_q` queries of each chunk: the prefill grid,
    varlen (a chunk of 3 queries takes one block, not a padded longest chunk's worth)."""
    flat: list[int] = []
    for index, row in enumerate(rows):
        for first in range(0, row.query_len, block_q):
            flat += (index, first)
    return flat


class PersistentInt32:
    """One device int32 buffer reused every step: `take(n)` is a view of its first n values (it regrows, by
    doubling, only when a step needs more)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffer = torch.zeros(0, dtype=torch.int32, device=device)

    def take(self, n: int) -> torch.Tensor:
        if n > self._buffer.numel():
            self._buffer = torch.zeros(max(n, 2 * self._buffer.numel(), 64), dtype=torch.int32, device=self._device)
        return self._buffer[:n]

    def fill_from_host(self, values: list[int]) -> torch.Tensor:
        """The values, copied into the buffer in one transfer (from pinned memory, without waiting, on CUDA)."""
        host = torch.tensor(values, dtype=torch.int32)
        out = self.take(len(values))
        if self._device.type == "cuda":
            host = host.pin_memory()
        out.copy_(host, non_blocking=self._device.type == "cuda")
        return out

    def fill_from(self, table: torch.Tensor) -> torch.Tensor:
        """`table` (any integer dtype, on the device) cast into the buffer, in its shape: a device-side copy."""
        out = self.take(table.numel()).view(table.shape)
        out.copy_(table)
        return out


@dataclass(slots=True)
class StepBuffers:
    """The backend's persistent buffers, one per table the kernels read."""

    decode_table: PersistentInt32
    decode_context_lens: PersistentInt32
    decode_query_rows: PersistentInt32
    prefill_table: PersistentInt32
    prefill_chunks: PersistentInt32
    prefill_programs: PersistentInt32

    @classmethod
    def on(cls, device: torch.device) -> StepBuffers:
        return cls(*(PersistentInt32(device) for _ in range(6)))


@dataclass(frozen=True, slots=True)
class DecodeTables:
    block_table: torch.Tensor  # [num_seqs, max_pages] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_rows: torch.Tensor  # [num_seqs] int32: each decode's row in the flattened batch (padding rows too)
    num_seqs: int
    max_context: int


@dataclass(frozen=True, slots=True)
class PrefillTables:
    block_table: torch.Tensor  # [num_chunks, max_pages] int32
    chunks: torch.Tensor  # [num_chunks, 3] int32: first row, query length, context length
    rows: tuple[PlanRow, ...]


@dataclass(slots=True)
class TritonStepPlan:
    """What every layer's forward of one step reads: the tables (filled once, in `plan`), and the prefill grid per
    query block size (built by the first layer that needs it: it depends on the layer's GQA group)."""

    meta: AttentionMetadata
    decode: DecodeTables | None
    prefill: PrefillTables | None
    buffers: StepBuffers
    _programs: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: AttentionMetadata, buffers: StepBuffers) -> TritonStepPlan:
        decode = prefill = None
        if meta.decode is not None:
            batch = meta.decode
            decode = DecodeTables(
                buffers.decode_table.fill_from(batch.block_table),
                buffers.decode_context_lens.fill_from(batch.context_lens),
                buffers.decode_query_rows.fill_from_host([row.query_start for row in batch.plan_rows]),
                len(batch.plan_rows),
                batch.max_context,
            )
        if meta.prefill is not None:
            batch = meta.prefill
            chunks = [value for row in batch.plan_rows for value in (row.query_start, row.query_len, row.context_len)]
            prefill = PrefillTables(
                buffers.prefill_table.fill_from(batch.block_table),
                buffers.prefill_chunks.fill_from_host(chunks).view(-1, 3),
                batch.plan_rows,
            )
        return cls(meta, decode, prefill, buffers)

    def prefill_grid(self, block_q: int) -> tuple[torch.Tensor, int]:
        """(the [num_programs, 2] int32 program table, num_programs) for blocks of `block_q` queries."""
        if block_q not in self._programs:
            flat = prefill_programs(self.prefill.rows, block_q)
            table = self.buffers.prefill_programs.fill_from_host(flat).view(-1, 2)
            self._programs = {block_q: (table, len(flat) // 2)}  # one buffer: a second size replaces the first
        return self._programs[block_q]

    def decode_span(self, window: int | None) -> int:
        """The longest run of keys any decode attends: its whole context, or its window where shorter."""
        longest = self.decode.max_context
        return longest if window is None else min(longest, window)
