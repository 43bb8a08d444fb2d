"""Embeddings: an embedding request's prompt hidden states pooled into one vector, in the prefill chunks that
compute them (no logits, no token sampled, no KV kept once it ends).

A chunk of positions [start, end) has those positions' hidden states; they pass the model's final norm (what
transformers' last_hidden_state is) and fold into the sequence's running pool: a sum for mean pooling, the first
position's row for cls, the last position's for last-token pooling. A sequence folds each position once, preemption
or not (Sequence.pooled_positions counts how far it got); under mean or cls pooling a prefix-cache hit never skips
a position not folded yet (Sequence.num_reusable_tokens), since the cache keeps K/V, not hidden states. Once the
chunk that holds the prompt's last position ran, the vector is truncated (Matryoshka `dimensions`), normalized
when asked, and sent as float32 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu_runtime.ipc.pooling import PoolingType

if TYPE_CHECKING:
    from gpu_runtime.model.registry import CausalLM
    from gpu_runtime.sequence import Sequence


@dataclass(frozen=True, slots=True)
class PooledChunk:
    """One embedding sequence's rows in a step: `count` rows from flat row `first_row`, the positions from
    `first_position` on; `completes` when they reach the prompt's end (its embedding is due this step)."""

    seq: Sequence
    first_row: int
    first_position: int
    count: int
    completes: bool


def chunk_to_pool(seq: Sequence, start: int, end: int, first_row: int) -> PooledChunk:
    """The rows of the chunk [start, end) (its first position at flat row `first_row`) that fold into the pool:
    from the first position not folded yet (a recomputation after preemption folds nothing twice)."""
    first = max(start, seq.pooled_positions)
    return PooledChunk(seq, first_row + first - start, first, max(0, end - first), end == seq.num_prompt_tokens)


@torch.inference_mode()
def pool_chunks(model: CausalLM, hidden: torch.Tensor, chunks: tuple[PooledChunk, ...]) -> None:
    """Folds each chunk's rows of `hidden` (the forward's output, before the final norm) into its sequence's pool.
    Only the rows a pooling type reads pass the norm: for last-token pooling one row per finished prompt."""
    for chunk in chunks:
        seq, params = chunk.seq, chunk.seq.params.pooling
        rows = _rows_read(chunk, params.type)
        if rows is not None:
            normed = model.norm(hidden[rows]).float()
            if params.type is PoolingType.MEAN:
                total = normed.sum(dim=0)
                seq.pooled = total if seq.pooled is None else seq.pooled + total
            else:  # the one row it reads
                seq.pooled = normed[-1]
        seq.pooled_positions = chunk.first_position + chunk.count


def _rows_read(chunk: PooledChunk, pooling: PoolingType) -> slice | None:
    if chunk.count == 0:
        return None
    if pooling is PoolingType.MEAN:
        return slice(chunk.first_row, chunk.first_row + chunk.count)
    if pooling is PoolingType.CLS:
        return slice(chunk.first_row, chunk.first_row + 1) if chunk.first_position == 0 else None
    last = chunk.first_row + chunk.count - 1
    return slice(last, last + 1) if chunk.completes else None


def embedding_bytes(seq: Sequence) -> bytes:
    """The finished sequence's embedding as float32 little-endian bytes: averaged (mean pooling), truncated to the
    request's dimensions, then L2-normalized when asked (the order OpenAI's and vLLM's `dimensions` use)."""
    params = seq.params.pooling
    vector = seq.pooled
    if params.type is PoolingType.MEAN:
        vector = vector / seq.num_prompt_tokens
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.to(device="cpu", dtype=torch.float32).numpy().astype("<f4", copy=False).tobytes()
