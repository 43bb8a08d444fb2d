"""Decode attention over pages: one SDPA per sequence vs one batched SDPA over keys padded to the longest.

Prints JSON with milliseconds per layer call for each batch size. Usage: .venv/bin/python scripts/bench_attention.py
The context lengths mimic a long-tail batch: most 100-600 tokens, one 1500.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.attention.metadata import AttentionMetadata, SequenceSpan  # noqa: E402
from gpu_runtime.attention.torch_paged import TorchPagedAttention  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 4, 2, 64, 16, 8192


def milliseconds(fn, repeats: int = 30) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - started) / repeats * 1e3, 3)


def measure(batch: int, generator: torch.Generator) -> dict:
    k_pages = torch.randn(NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v_pages = torch.randn(NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    lengths = torch.randint(100, 600, (batch,), generator=generator)
    lengths[0] = 1500
    max_pages = -(-int(lengths.max()) // PAGE_SIZE)
    tables = torch.stack([torch.randperm(NUM_PAGES, generator=generator)[:max_pages] for _ in range(batch)])
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    new_k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    spans = tuple(SequenceSpan(i, 1, int(n), tables[i, : -(-int(n) // PAGE_SIZE)]) for i, n in enumerate(lengths))
    slots = torch.tensor(
        [
            int(tables[i, (int(n) - 1) // PAGE_SIZE]) * PAGE_SIZE + (int(n) - 1) % PAGE_SIZE
            for i, n in enumerate(lengths)
        ]
    )
    meta = AttentionMetadata(slot_mapping=slots, spans=spans)
    backend = TorchPagedAttention()

    def per_sequence():
        return backend.forward(q, new_k, new_k, k_pages, v_pages, meta)

    mask = (torch.arange(max_pages * PAGE_SIZE)[None] < lengths[:, None]).view(batch, 1, 1, -1)

    def padded_batch():
        def gather(pages):
            flat = pages.index_select(0, tables.flatten())
            return flat.view(batch, max_pages * PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)

        grouped = q.view(batch, NUM_KV_HEADS, GROUP, HEAD_DIM)
        return F.scaled_dot_product_attention(grouped, gather(k_pages), gather(v_pages), attn_mask=mask)

    per_seq_out = per_sequence()
    padded_out = padded_batch().reshape(batch, NUM_KV_HEADS * GROUP, HEAD_DIM)
    return {
        "batch": batch,
        "per_sequence_ms": milliseconds(per_sequence),
        "padded_batch_ms": milliseconds(padded_batch),
        "max_abs_difference": float((per_seq_out - padded_out).abs().max()),
    }


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = [measure(batch, generator) for batch in (1, 4, 16, 64)]
    for row in rows:
        row["padded_over_per_sequence"] = round(row["padded_batch_ms"] / row["per_sequence_ms"], 2)
    print(json.dumps({"torch_threads": torch.get_num_threads(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
