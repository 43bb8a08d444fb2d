"""Per-step attention metadata: where each new token's K/V goes and which pages each sequence reads.

Built once per step (gpu_runtime/step_inputs.py) from one host buffer copied to the device in one go, and
shared by every layer: block tables, context lengths and masks are batch tensors, never per-layer work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """One sequence's rows in the flattened batch: a decode (one query) or a prefill (a run of them)."""

    query_start: int  # first row of this sequence in the flattened token batch
    query_len: int  # new tokens computed this step
    context_len: int  # tokens in the cache after this step, the new ones included
    page_ids: torch.Tensor  # [ceil(context_len / page_size)] pages holding the context, in order

    @property
    def has_cached_prefix(self) -> bool:
        return self.context_len > self.query_len


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Every single-query row of the step (decodes, and a static batch's padding rows), attended in one call."""

    rows: slice | torch.Tensor  # their rows in the flattened batch (a slice unless padding rows join them)
    block_table: torch.Tensor  # [num_seqs, max_pages] each row's pages in order, padded with page 0
    context_lens: torch.Tensor  # [num_seqs]
    key_mask: torch.Tensor  # [num_seqs, 1, 1, max_context] True where the key is in the row's context
    max_context: int


@dataclass(frozen=True, slots=True)
class PrefillBatch:
    """Every prompt chunk of the step, attended in one call with queries padded to the longest chunk."""

    rows: slice  # the chunks' rows, back to back after the decodes
    block_table: torch.Tensor  # [num_seqs, max_pages]
    query_rows: torch.Tensor  # [num_seqs, max_query] flat row of each padded query; pads repeat the chunk's last
    real_queries: torch.Tensor  # positions in the padded [num_seqs * max_query] order of the real ones, in row order
    mask: torch.Tensor  # [num_seqs, 1, max_query, max_context] causal within each sequence's context
    max_context: int
    # One chunk and nothing cached before it: its own fresh K/V is its whole context, no pages are read.
    is_one_fresh_prompt: bool


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The flattened batch holds each sequence's new tokens back to back: decodes, then prefills, then a static
    batch's padding rows; no sequence's keys are padded to another's length in `spans`."""

    # Flat cache slot (page * page_size + offset) of each new token; the rows after the last one, if any, are
    # padding (a static batch's finished sequences): computed, never stored.
    slot_mapping: torch.Tensor
    spans: tuple[SequenceSpan, ...]  # per sequence, for backends that attend one sequence at a time
    decode: DecodeBatch | None = None  # for batched backends: the single-query rows
    prefill: PrefillBatch | None = None  # and the prompt chunks
