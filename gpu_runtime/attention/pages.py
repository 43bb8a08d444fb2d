"""What every paged backend does with the pool: store the step's new K/V, and read a batch's pages."""

from __future__ import annotations

import torch


def write_pages(k, v, k_pages: torch.Tensor, v_pages: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores each new token's K/V at its flat slot; the rows past the slot mapping are padding, not stored."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    stored = slot_mapping.numel()
    k_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k[:stored])
    v_pages.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v[:stored])


def gather_batch(pages: torch.Tensor, block_table: torch.Tensor, max_context: int) -> torch.Tensor:
    """[num_seqs, kv_heads, max_context, head_dim]: each sequence's pages, in order, in one gather.

    Keys past a sequence's own context (the rest of its last page, and the page-0 padding of short block
    tables) are read too; the caller's mask hides them.
    """
    num_seqs, max_pages = block_table.shape
    gathered = pages.index_select(0, block_table.flatten())  # [num_seqs * max_pages, page_size, heads, dim]
    return gathered.view(num_seqs, max_pages * pages.shape[1], *pages.shape[2:])[:, :max_context].transpose(1, 2)
