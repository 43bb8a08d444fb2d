"""The reference paged attention in plain torch (CPU and CUDA): per sequence, gather its pages and call SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.attention.metadata import AttentionMetadata, SequenceSpan
from gpu_runtime.attention.pages import write_pages


class TorchPagedAttention(AttentionBackend):
    """One SDPA call per sequence over exactly its own context: the simplest correct backend, kept as the
    reference the batched one is checked against (and the slower of the two: a call per sequence per layer)."""

    name = "torch"
    uses_spans = True

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in meta.spans:
            rows = slice(span.query_start, span.query_start + span.query_len)
            if span.has_cached_prefix:
                keys, values = _gather_context(k_pages, span), _gather_context(v_pages, span)
            else:  # nothing cached before this span: its own fresh K/V is the whole context
                keys, values = k[rows], v[rows]
            out[rows] = _attend(q[rows], keys, values)
        return out


def _gather_context(pages: torch.Tensor, span: SequenceSpan) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim]: the span's pages copied as whole contiguous blocks."""
    return pages.index_select(0, span.page_ids).flatten(0, 1)[: span.context_len]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Causal attention of [query_len, heads, dim] queries that end the [context_len, kv_heads, dim] context."""
    query_len, num_heads, head_dim = q.shape
    context_len, num_kv_heads = keys.shape[0], keys.shape[1]
    k_ = keys.transpose(0, 1).unsqueeze(0)
    v_ = values.transpose(0, 1).unsqueeze(0)
    if query_len == 1:
        # Grouped-query decode without repeating K/V: the query heads sharing a KV head become that
        # head's "query positions" in one SDPA; a single last query needs no mask.
        q_grouped = q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        return F.scaled_dot_product_attention(q_grouped, k_, v_).reshape(1, num_heads, head_dim)
    q_ = q.transpose(0, 1).unsqueeze(0)
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
    else:
        # Query i sits at position context_len - query_len + i and sees every key up to it.
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        mask = torch.arange(context_len, device=q.device)[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
