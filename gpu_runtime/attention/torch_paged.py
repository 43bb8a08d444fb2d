"""The reference paged attention in plain torch (CPU and CUDA): per sequence, gather its pages and call SDPA.

The reference for every option a layer can ask for (a sliding window, soft-capped logits, its own scale): the
other backends are checked against it, and a model family's options run here before any kernel has them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, require_planned
from gpu_runtime.attention.metadata import AttentionMetadata, DecodeBatch, PrefillBatch
from gpu_runtime.attention.pages import write_pages


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
class StepSpans:
    meta: AttentionMetadata  # the step they were cut from
    spans: tuple[SequenceSpan, ...]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StepSpans:
        return cls(meta, _spans(meta.decode) + _spans(meta.prefill))


def _spans(batch: DecodeBatch | PrefillBatch | None) -> tuple[SequenceSpan, ...]:
    """Each sequence's span; its pages are a view of its block-table row (the host knows how many: no read-back)."""
    if batch is None:
        return ()
    return tuple(
        SequenceSpan(row.query_start, row.query_len, row.context_len, batch.block_table[i, : len(row.pages)])
        for i, row in enumerate(batch.plan_rows)
    )


class TorchPagedAttention(AttentionBackend):
    """One SDPA call per sequence over exactly its own context: the simplest correct backend, kept as the
    reference the batched one is checked against (and the slower of the two: a call per sequence per layer)."""

    name = "torch"

    def __init__(self) -> None:
        self._step: StepSpans | None = None
        self._group_spans: dict[int, tuple[SequenceSpan, ...]] = {}  # a hybrid model's other KV groups', by id(meta)

    def check_options(self, options: LayerAttentionOptions) -> None:
        pass  # it honours every option

    def plan(self, meta: AttentionMetadata) -> None:
        self._step = StepSpans.of(meta)
        self._group_spans = {id(group): StepSpans.of(group).spans for group in meta.other_groups}

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata, options: LayerAttentionOptions):
        step = require_planned(self._step, meta, self.name)
        spans = step.spans if meta is step.meta else self._group_spans[id(meta)]
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for span in spans:
            rows = slice(span.query_start, span.query_start + span.query_len)
            if span.has_cached_prefix:
                keys, values = _gather_context(k_pages, span), _gather_context(v_pages, span)
            else:  # nothing cached before this span: its own fresh K/V is the whole context
                keys, values = k[rows], v[rows]
            if options.is_plain:
                out[rows] = _attend(q[rows], keys, values, options.scale)
            else:
                out[rows] = attend_with_options(q[rows], keys, values, options)
        return out


def _gather_context(pages: torch.Tensor, span: SequenceSpan) -> torch.Tensor:
    """[context_len, num_kv_heads, head_dim]: the span's pages copied as whole contiguous blocks."""
    return pages.index_select(0, span.page_ids).flatten(0, 1)[: span.context_len]


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of [query_len, heads, dim] queries that end the [context_len, kv_heads, dim] context."""
    query_len, num_heads, head_dim = q.shape
    context_len, num_kv_heads = keys.shape[0], keys.shape[1]
    k_ = keys.transpose(0, 1).unsqueeze(0)
    v_ = values.transpose(0, 1).unsqueeze(0)
    if query_len == 1:
        # Grouped-query decode without repeating K/V: the query heads sharing a KV head become that
        # head's "query positions" in one SDPA; a single last query needs no mask.
        q_grouped = q.reshape(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        return F.scaled_dot_product_attention(q_grouped, k_, v_, scale=scale).reshape(1, num_heads, head_dim)
    q_ = q.transpose(0, 1).unsqueeze(0)
    if query_len == context_len:
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(
            q_, k_, v_, attn_mask=visible_keys(query_len, context_len, None, q.device), enable_gqa=True, scale=scale
        )
    return out.squeeze(0).transpose(0, 1)


def visible_keys(query_len: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """[query_len, context_len] True where a query sees the key: query i sits at position context_len - query_len + i
    and sees every key up to it, or with a window only the `window` positions ending at it."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)[:, None]
    key_pos = torch.arange(context_len, device=device)[None, :]
    visible = key_pos <= query_pos
    return visible if window is None else visible & (key_pos > query_pos - window)


def attend_with_options(q, keys, values, options: LayerAttentionOptions) -> torch.Tensor:
    """`_attend` with a window and soft-capped logits, written out (SDPA has no soft-cap): the scores in float32,
    as transformers' eager attention computes them, returned in the queries' dtype."""
    query_len, num_heads, _ = q.shape
    context_len, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    k_ = keys.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, context, dim]
    v_ = values.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(q.float().transpose(0, 1), k_.transpose(1, 2)) * options.scale  # [heads, queries, keys]
    if options.logit_softcap is not None:
        scores = options.logit_softcap * torch.tanh(scores / options.logit_softcap)
    visible = visible_keys(query_len, context_len, options.sliding_window, q.device)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.matmul(weights, v_).transpose(0, 1).to(q.dtype)
