"""Per-step attention metadata: where each new token's K/V goes and which pages each sequence reads."""

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
class AttentionMetadata:
    """Built once per step and shared by every layer.

    The flattened batch holds each sequence's new tokens back to back (decodes first, then prefills; padding
    rows only in static batching, last), and no sequence's keys are padded to another's length.
    """

    # Flat cache slot (page * page_size + offset) of each new token; the rows after the last one, if any, are
    # padding (a static batch's finished sequences): computed, never stored.
    slot_mapping: torch.Tensor
    spans: tuple[SequenceSpan, ...]
