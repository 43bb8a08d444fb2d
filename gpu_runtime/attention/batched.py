"""Paged attention for the whole batch: one SDPA call for the step's decodes, one for its prompt chunks.

Each call gathers its sequences' pages through the block table in one index_select, pads every context to the
longest with a mask, and runs one SDPA; nothing loops over sequences, so a step at batch 64 makes the same
number of calls per layer as a step at batch 1 (one, or two when decodes and prompt chunks share the step). The
masks are built once per step, in `plan`, and read by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, require_planned
from gpu_runtime.attention.metadata import AttentionMetadata, DecodeBatch, PrefillBatch
from gpu_runtime.attention.pages import gather_batch, write_pages


@dataclass(frozen=True, slots=True)
class SdpaMasks:
    """A step's padding masks, for every layer's SDPA calls."""

    meta: AttentionMetadata  # the step they were built for
    decode: torch.Tensor | None  # [num_seqs, 1, 1, max_context] True where the key is in the row's context
    prefill: torch.Tensor | None  # [num_seqs, 1, max_query, max_context] causal within each sequence's context

    @classmethod
    def of(cls, meta: AttentionMetadata, with_decode: bool = True) -> SdpaMasks:
        decode = decode_key_mask(meta.decode) if with_decode and meta.decode is not None else None
        prefill = prefill_causal_mask(meta.prefill) if meta.prefill is not None else None
        return cls(meta, decode, prefill)


def decode_key_mask(batch: DecodeBatch) -> torch.Tensor:
    keys = torch.arange(batch.max_context, device=batch.context_lens.device)
    return (keys[None, :] < batch.context_lens[:, None])[:, None, None, :]


def prefill_causal_mask(batch: PrefillBatch) -> torch.Tensor | None:
    """None for one fresh prompt: its SDPA is causal by itself, over its own K/V."""
    if batch.is_one_fresh_prompt:
        return None
    keys = torch.arange(batch.max_context, device=batch.query_positions.device)
    return (keys[None, None, :] <= batch.query_positions[:, :, None])[:, None]


class BatchedPagedAttention(AttentionBackend):
    name = "batched"

    def __init__(self) -> None:
        self._masks: SdpaMasks | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        self._masks = SdpaMasks.of(meta)

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata, options: LayerAttentionOptions):
        masks = require_planned(self._masks, meta, self.name)
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            rows = meta.decode.rows
            out[rows] = decode_attention(q[rows], k_pages, v_pages, meta.decode, masks.decode, options.scale)
        if meta.prefill is not None:
            rows = meta.prefill.rows
            out[rows] = prefill_attention(q, k[rows], v[rows], k_pages, v_pages, meta.prefill, masks.prefill,
                                          options.scale)  # fmt: skip
        return out


def decode_attention(q: torch.Tensor, k_pages, v_pages, batch: DecodeBatch, key_mask, scale: float) -> torch.Tensor:
    """[num_seqs, heads, dim]: each single query over its own context, all sequences in one SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    keys = gather_batch(k_pages, batch.block_table, batch.max_context)  # [num_seqs, kv_heads, context, dim]
    values = gather_batch(v_pages, batch.block_table, batch.max_context)
    num_kv_heads = keys.shape[1]
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that head's
    # "query positions"; the mask hides the keys past each sequence's context.
    grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=key_mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q_all: torch.Tensor, k, v, k_pages, v_pages, batch: PrefillBatch, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """[chunk rows, heads, dim]: every chunk's queries, causal over its cached prefix and itself, in one SDPA
    (`mask`: prefill_causal_mask of the batch)."""
    if batch.is_one_fresh_prompt:  # its own K/V is the whole context: no pages to read, no padding
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_all[batch.rows], k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
        return out.squeeze(0).transpose(0, 1)
    num_seqs, max_query = batch.query_rows.shape
    num_heads, head_dim = q_all.shape[1], q_all.shape[2]
    queries = q_all.index_select(0, batch.query_rows.flatten()).view(num_seqs, max_query, num_heads, head_dim)
    keys = gather_batch(k_pages, batch.block_table, batch.max_context)
    values = gather_batch(v_pages, batch.block_table, batch.max_context)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True, scale=scale
    )
    return out.transpose(1, 2).flatten(0, 1).index_select(0, batch.real_queries)
