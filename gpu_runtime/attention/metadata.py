"""Per-step attention metadata: where each new token's K/V goes and which pages each sequence reads.

Built once per step (gpu_runtime/step_inputs.py) from one host buffer copied to the device in one go, and
shared by every layer: block tables and context lengths are batch tensors, never per-layer work. What only some
backends read (SDPA masks, per-sequence spans) each backend derives itself, in its `plan`, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import torch


class PlanRow(msgspec.Struct, frozen=True, array_like=True):
    """One sequence's part of the step, as plain host integers (tensor-parallel ranks receive them as they are)."""

    query_start: int  # its first row in the flattened batch
    query_len: int
    context_len: int  # tokens in its cache after the step
    pages: list[int]  # the pages holding those tokens, in order


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Every single-query row of the step (decodes, and a static batch's padding rows), attended in one call."""

    rows: slice | torch.Tensor  # their rows in the flattened batch (a slice unless padding rows join them)
    block_table: torch.Tensor  # [num_seqs, max_pages] each row's pages in order, padded with page 0
    context_lens: torch.Tensor  # [num_seqs]
    max_context: int
    plan_rows: tuple[PlanRow, ...]  # the same rows on the host, in block-table order (no device read needed)


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Every prompt chunk of the step, attended in one call with queries padded to the longest chunk."""

    rows: slice  # the chunks' rows, back to back after the decodes
    block_table: torch.Tensor  # [num_seqs, max_pages]
    query_rows: torch.Tensor  # [num_seqs, max_query] flat row of each padded query; pads repeat the chunk's last
    query_positions: torch.Tensor  # [num_seqs, max_query] the position of each padded query
    real_queries: torch.Tensor  # positions in the padded [num_seqs * max_query] order of the real ones, in row order
    max_context: int
    # One chunk and nothing cached before it: its own fresh K/V is its whole context, no pages are read.
    is_one_fresh_prompt: bool
    plan_rows: tuple[PlanRow, ...]  # the chunks on the host, in block-table order


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The flattened batch holds each sequence's new tokens back to back: decodes, then prefills, then a static
    batch's padding rows."""

    # Flat cache slot (page * page_size + offset) of each new token; the rows after the last one, if any, are
    # padding (a static batch's finished sequences): computed, never stored.
    slot_mapping: torch.Tensor
    decode: DecodeBatch | None = None  # the single-query rows
    prefill: PrefillBatch | None = None  # the prompt chunks
    # A hybrid model's other KV groups (gpu_runtime/kv_cache/kv_groups.py): the same rows at their own pages (their
    # block tables and slots), each planned as this one is (`planned`); empty where one group holds every layer.
    other_groups: tuple[AttentionMetadata, ...] = ()
    planned: AttentionMetadata | None = None  # the first group's metadata, which the backend's plan was given

    def of_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group `group`'s layers."""
        return self if group == 0 else self.other_groups[group - 1]

    @property
    def step(self) -> AttentionMetadata:
        """The metadata the backend planned this step with (a group's rows, masks and spans are the first group's)."""
        return self.planned or self
