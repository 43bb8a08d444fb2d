"""Paged attention for the whole batch: one SDPA call for the step's decodes, one for its prompt chunks.

Each call gathers its sequences' pages through the block table in one index_select, pads every context to the
longest with a mask, and runs one SDPA; nothing loops over sequences, so a step at batch 64 makes the same
number of calls per layer as a step at batch 1 (one, or two when decodes and prompt chunks share the step). The
masks are built once per step, in `plan`, and read by every layer (a sliding window's once per step too, by the
first layer with it). A layer's sliding window is in its mask; its soft-capped logits are the same attention written
out in float32 (SDPA has no soft-cap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, require_planned
from gpu_runtime.attention.metadata import AttentionMetadata, DecodeBatch, PrefillBatch
from gpu_runtime.attention.pages import gather_batch, write_pages
from gpu_runtime.attention.torch_paged import visible_keys


class StepMasks:
    """A step's masks for every layer's SDPA calls, by sliding window (None: full attention): each built by the
    first layer that needs it, in the step `plan` was given, and read by every other layer with the same window."""

    def __init__(self, meta: AttentionMetadata):
        self.meta = meta  # the step they are built for
        self._decode: dict[int | None, torch.Tensor] = {}
        self._prefill: dict[int | None, torch.Tensor | None] = {}

    def decode(self, window: int | None) -> torch.Tensor:
        """[num_seqs, 1, 1, max_context] True where the key is in the row's context (and window)."""
        if window not in self._decode:
            self._decode[window] = decode_key_mask(self.meta.decode, window)
        return self._decode[window]

    def prefill(self, window: int | None) -> torch.Tensor | None:
        """[num_seqs, 1, max_query, max_context] causal within each sequence's context (and window)."""
        if window not in self._prefill:
            self._prefill[window] = prefill_causal_mask(self.meta.prefill, window)
        return self._prefill[window]


def decode_key_mask(batch: DecodeBatch, window: int | None = None) -> torch.Tensor:
    """True where a row's key is in its context (and, with a window, among the last `window` positions)."""
    keys = torch.arange(batch.max_context, device=batch.context_lens.device)
    visible = keys[None, :] < batch.context_lens[:, None]
    if window is not None:  # the query sits at context_len - 1 and sees the `window` positions ending there
        visible &= keys[None, :] >= batch.context_lens[:, None] - window
    return visible[:, None, None, :]


def prefill_causal_mask(batch: PrefillBatch, window: int | None = None) -> torch.Tensor | None:
    """None for one fresh prompt without a window: its SDPA is causal by itself, over its own K/V."""
    if batch.is_one_fresh_prompt:
        if window is None:
            return None
        length = batch.query_positions.shape[1]  # its own K/V is the whole context
        return visible_keys(length, length, window, batch.query_positions.device)
    keys = torch.arange(batch.max_context, device=batch.query_positions.device)
    visible = keys[None, None, :] <= batch.query_positions[:, :, None]
    if window is not None:
        visible &= keys[None, None, :] > batch.query_positions[:, :, None] - window
    return visible[:, None]


class BatchedPagedAttention(AttentionBackend):
    name = "batched"

    def __init__(self) -> None:
        self._masks: StepMasks | None = None

    def check_options(self, options: LayerAttentionOptions) -> None:
        pass  # windows are masks, soft-capped logits the same attention written out (attend)

    def plan(self, meta: AttentionMetadata) -> None:
        self._masks = StepMasks(meta)

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata, options: LayerAttentionOptions):
        masks = require_planned(self._masks, meta, self.name)
        window = options.sliding_window
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.decode is not None:
            rows = meta.decode.rows
            out[rows] = decode_attention(q[rows], k_pages, v_pages, meta.decode, masks.decode(window), options)
        if meta.prefill is not None:
            rows = meta.prefill.rows
            out[rows] = prefill_attention(q, k[rows], v[rows], k_pages, v_pages, meta.prefill,
                                          masks.prefill(window), options)  # fmt: skip
        return out


def attend(q, k, v, mask, options: LayerAttentionOptions, is_causal: bool = False, gqa: bool = True) -> torch.Tensor:
    """SDPA of [..., heads, queries, dim] over [..., kv_heads, keys, dim] (grouped), with the layer's scale and
    `mask` (its window is in the mask); where the layer soft-caps its logits, the same attention written out (SDPA
    has no soft-cap), its scores in float32 as transformers' eager attention computes them."""
    if options.logit_softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, scale=options.scale
        )
    group = q.shape[-3] // k.shape[-3]
    k = k.float().repeat_interleave(group, dim=-3)
    v = v.float().repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * options.scale
    scores = options.logit_softcap * torch.tanh(scores / options.logit_softcap)
    if is_causal:
        mask = visible_keys(q.shape[-2], k.shape[-2], None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).to(q.dtype)


def decode_attention(
    q: torch.Tensor, k_pages, v_pages, batch: DecodeBatch, key_mask, options: LayerAttentionOptions
) -> torch.Tensor:
    """[num_seqs, heads, dim]: each single query over its own context, all sequences in one SDPA."""
    num_seqs, num_heads, head_dim = q.shape
    keys = gather_batch(k_pages, batch.block_table, batch.max_context)  # [num_seqs, kv_heads, context, dim]
    values = gather_batch(v_pages, batch.block_table, batch.max_context)
    num_kv_heads = keys.shape[1]
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that head's
    # "query positions"; the mask hides the keys past each sequence's context (and before its window).
    grouped = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = attend(grouped, keys, values, key_mask, options, gqa=False)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    q_all: torch.Tensor, k, v, k_pages, v_pages, batch: PrefillBatch, mask: torch.Tensor | None,
    options: LayerAttentionOptions,
) -> torch.Tensor:  # fmt: skip
    """[chunk rows, heads, dim]: every chunk's queries, causal over its cached prefix and itself, in one SDPA
    (`mask`: prefill_causal_mask of the batch, with the layer's window)."""
    if batch.is_one_fresh_prompt:  # its own K/V is the whole context: no pages to read, no padding
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_all[batch.rows], k, v))
        out = attend(q, k, v, mask, options, is_causal=mask is None)
        return out.squeeze(0).transpose(0, 1)
    num_seqs, max_query = batch.query_rows.shape
    num_heads, head_dim = q_all.shape[1], q_all.shape[2]
    queries = q_all.index_select(0, batch.query_rows.flatten()).view(num_seqs, max_query, num_heads, head_dim)
    keys = gather_batch(k_pages, batch.block_table, batch.max_context)
    values = gather_batch(v_pages, batch.block_table, batch.max_context)
    out = attend(queries.transpose(1, 2), keys, values, mask, options)
    return out.transpose(1, 2).flatten(0, 1).index_select(0, batch.real_queries)
