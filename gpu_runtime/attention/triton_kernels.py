"""The Triton paged-attention kernels: split-KV decode (and its combine), and varlen causal prefill over the pages.

Every kernel reads K/V where they lie in the page pool, token by token through the block table (any page size, 1
included), and never copies a sequence's context anywhere. Queries sharing a KV head are one program's rows, so
each K/V tile is read once per KV head, not once per query head (grouped-query attention). Scores are float32; a
layer's scale, soft-cap and sliding window are applied in the kernel.

Triton decides at decoration time whether a kernel is compiled or interpreted: `TRITON_INTERPRET=1` must be set
before this module is imported for it to run on a CPU (the backend checks, triton_paged.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _soft_cap(scores, cap):
    # cap * tanh(scores / cap), with tanh as 1 - 2 / (exp(2x) + 1) (triton.language has no tanh): exact at both
    # ends, where exp overflows to inf (1) or underflows to 0 (-1), and within float32 rounding near 0.
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def _token_offsets(block_table_row_ptr, tokens, token_mask, kv_head, stride_page, stride_slot, stride_head,
                   PAGE_SIZE: tl.constexpr):  # fmt: skip
    # [BLOCK_N] where each token's K (and V: the two pools share a layout) row starts, found through the block
    # table: one read of it serves both. The page index is widened before it scales, so a pool of more than 2**31
    # elements is addressed correctly.
    page = tl.load(block_table_row_ptr + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    return page * stride_page + (tokens % PAGE_SIZE) * stride_slot + kv_head * stride_head


@triton.jit
def decode_partition_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, out_ptr, block_table_ptr, context_lens_ptr, query_rows_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale, soft_cap, window, partition_size, max_partitions,
    stride_q_row, stride_q_head, stride_o_row, stride_o_head, stride_table,
    stride_page, stride_slot, stride_head,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, ONE_PARTITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: one decode's query heads of one KV head, over one partition of its context (grid: sequences,
    KV heads, partitions). With one partition it writes the output; else its unnormalised sum, running max and
    softmax denominator, which decode_combine_kernel merges."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    query_row = tl.load(query_rows_ptr + seq).to(tl.int64)
    span_start = 0
    if USE_WINDOW:  # the query sits at context_len - 1 and sees the `window` positions ending there
        span_start = tl.maximum(context_len - window, 0)
    part_start = span_start + part * partition_size
    part_end = tl.minimum(part_start + partition_size, context_len)

    group = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    group_mask = group < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + group
    q = tl.load(
        q_ptr + query_row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
        mask=group_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    table_row = block_table_ptr + seq.to(tl.int64) * stride_table
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # Every tile of the loop holds at least one key every row sees (all rows share one position), so the running
    # max is finite from the first tile on and no row's softmax divides 0 by 0.
    for tile_start in range(part_start, part_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < part_end
        kv_offsets = _token_offsets(table_row, tokens, token_mask, kv_head, stride_page, stride_slot, stride_head,
                                    PAGE_SIZE)[:, None] + dims[None, :]  # fmt: skip
        tile_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offsets, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            scores = _soft_cap(scores, soft_cap)
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        denominator = denominator * rescale + tl.sum(weights, 1)
        v = tl.load(v_pages_ptr + kv_offsets, mask=tile_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    row_mask = group_mask[:, None] & dim_mask[None, :]
    if ONE_PARTITION:
        out = acc / denominator[:, None]
        out_offsets = query_row * stride_o_row + heads[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:  # partials are [num_seqs, NUM_HEADS, max_partitions] (and a BLOCK_D row each), contiguous
        slot = (seq * NUM_HEADS + heads).to(tl.int64) * max_partitions + part
        tl.store(part_acc_ptr + slot[:, None] * BLOCK_D + dims[None, :], acc, mask=row_mask)
        tl.store(part_max_ptr + slot, running_max, mask=group_mask)
        tl.store(part_sum_ptr + slot, denominator, mask=group_mask)


@triton.jit
def decode_combine_kernel(
    out_ptr, context_lens_ptr, query_rows_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    window, partition_size, max_partitions, stride_o_row, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):  # fmt: skip
    """One program per (decode, query head): the softmax over its whole context from its partitions' partials, each
    rescaled by exp(its max - the overall max). Only the sequence's own partitions are read (a short context in a
    long step has fewer)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    span = context_len
    if USE_WINDOW:
        span = tl.minimum(context_len, window)
    num_parts = tl.cdiv(span, partition_size)
    first_slot = (seq * NUM_HEADS + head).to(tl.int64) * max_partitions
    parts = tl.arange(0, BLOCK_P)
    part_mask = parts < num_parts
    maxima = tl.load(part_max_ptr + first_slot + parts, mask=part_mask, other=float("-inf"))
    overall_max = tl.max(maxima, 0)
    rescale = tl.exp(maxima - overall_max)  # 0 for the partitions past the sequence's own
    sums = tl.load(part_sum_ptr + first_slot + parts, mask=part_mask, other=0.0)
    denominator = tl.sum(sums * rescale, 0)
    dims = tl.arange(0, BLOCK_D)
    acc = tl.load(
        part_acc_ptr + (first_slot + parts)[:, None] * BLOCK_D + dims[None, :], mask=part_mask[:, None], other=0.0
    )
    out = tl.sum(acc * rescale[:, None], 0) / denominator
    query_row = tl.load(query_rows_ptr + seq).to(tl.int64)
    tl.store(out_ptr + query_row * stride_o_row + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)  # fmt: skip


@triton.jit
def prefill_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, out_ptr, block_table_ptr, chunks_ptr, programs_ptr,
    scale, soft_cap, window,
    stride_q_row, stride_q_head, stride_o_row, stride_o_head, stride_table,
    stride_page, stride_slot, stride_head,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SOFT_CAP: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_Q consecutive queries of one prompt chunk, for the GROUP query heads of one KV head (its
    BLOCK_M rows are query-major: row r is query r // GROUP, head r % GROUP), causal over the chunk's cached prefix
    and itself, all read from the pages (grid: the step's query blocks, KV heads). `programs` maps a program to its
    chunk and first query; `chunks` holds each chunk's first row, length and context length."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(programs_ptr + 2 * program)
    first_query = tl.load(programs_ptr + 2 * program + 1)
    query_start = tl.load(chunks_ptr + 3 * chunk)
    query_len = tl.load(chunks_ptr + 3 * chunk + 1)
    context_len = tl.load(chunks_ptr + 3 * chunk + 2)
    first_position = context_len - query_len  # the chunk's queries follow its cached prefix

    rows = tl.arange(0, BLOCK_M)
    queries = first_query + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (queries < query_len)
    positions = first_position + queries
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    flat_rows = (query_start + queries).to(tl.int64)
    q = tl.load(
        q_ptr + flat_rows[:, None] * stride_q_row + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    # The keys any of the block's queries sees: up to its last query's position, and with a window from its first
    # query's first key on (rounded down to a tile, so tiles stay page-aligned when BLOCK_N is a multiple of a page).
    last_query = tl.minimum(first_query + BLOCK_Q, query_len) - 1
    keys_end = first_position + last_query + 1
    keys_start = 0
    if USE_WINDOW:
        keys_start = tl.maximum(first_position + first_query - window + 1, 0) // BLOCK_N * BLOCK_N
    table_row = block_table_ptr + chunk.to(tl.int64) * stride_table
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(keys_start, keys_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < keys_end
        kv_offsets = _token_offsets(table_row, tokens, token_mask, kv_head, stride_page, stride_slot, stride_head,
                                    PAGE_SIZE)[:, None] + dims[None, :]  # fmt: skip
        tile_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_pages_ptr + kv_offsets, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if USE_SOFT_CAP:
            scores = _soft_cap(scores, soft_cap)
        visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        if USE_WINDOW:
            visible = visible & (tokens[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # A row may see no key of a tile (before its window, or a padding row): its max stays -inf, and exp is
        # taken from 0 instead so that -inf - -inf never makes a NaN; its weights are exp(-inf) = 0.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp(running_max - safe_max)
        weights = tl.exp(scores - safe_max[:, None])
        denominator = denominator * rescale + tl.sum(weights, 1)
        v = tl.load(v_pages_ptr + kv_offsets, mask=tile_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        running_max = new_max

    out = acc / tl.where(denominator == 0.0, 1.0, denominator)[:, None]  # 0 only in padding rows, never stored
    out_offsets = flat_rows[:, None] * stride_o_row + heads[:, None] * stride_o_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
