"""Per-step attention metadata: where each new token's K/V goes and which pages each sequence reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One sequence computing several tokens this step (a prompt, a prompt chunk, or a recompute)."""

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

    The flattened batch holds the decode tokens first (one per decoding sequence, rows
    [0, num_decodes)), then each prefill span back to back, so no row is padding.
    """

    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot (page * page_size + offset) per new token
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_pages] page ids, padded with page 0
    decode_key_mask: torch.Tensor  # [num_decodes, 1, 1, max_pages * page_size], True where a key exists
    prefills: tuple[PrefillSpan, ...]
