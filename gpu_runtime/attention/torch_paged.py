"""Portable paged attention in plain torch (CPU and CUDA): gathers pages and calls SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata, PrefillSpan


class TorchPagedAttention(AttentionBackend):
    """Decodes run as one batched SDPA over their gathered pages; each prefill span runs as its own SDPA.

    A prefill span is long enough that one call per span costs nothing next to its work, while the
    decodes, one query each, would drown in per-call overhead if they were not batched.
    """

    name = "torch"

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        _write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = _decode_attention(q[: meta.num_decodes], k_pages, v_pages, meta)
        for span in meta.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            if span.has_cached_prefix:
                keys = _gather_context(k_pages, span)
                values = _gather_context(v_pages, span)
            else:  # nothing cached before this span: its own fresh K/V is the whole context
                keys, values = k[rows], v[rows]
            out[rows] = _prefill_attention(q[rows], keys, values)
        return out


def _write_pages(k, v, k_pages, v_pages, slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_context(pages: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
    gathered = pages.index_select(0, span.page_ids)
    return gathered.flatten(0, 1)[: span.context_len]


def _prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    query_len, context_len = q.shape[0], keys.shape[0]
    q_, k_, v_ = (t.transpose(0, 1).unsqueeze(0) for t in (q, keys, values))
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
    else:
        # Query i sits at position context_len - query_len + i and sees every key up to it.
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def _decode_attention(q: torch.Tensor, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
    num_decodes, num_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[2]
    group = num_heads // num_kv_heads
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become
    # that head's "query positions", so one SDPA serves the whole group.
    q_grouped = q.view(num_decodes, num_kv_heads, group, head_dim)
    keys = k_pages[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
    values = v_pages[meta.decode_block_tables].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q_grouped, keys, values, attn_mask=meta.decode_key_mask)
    return out.reshape(num_decodes, num_heads, head_dim)
