"""Decode attention over pages, one layer's call, each backend: per sequence (torch), one batched SDPA over
gathered pages (batched), and the CPU kernel that reads the pages in place (cpu_paged).

Prints JSON with milliseconds per layer call for each batch size. Usage: .venv/bin/python scripts/bench_attention.py
The context lengths mimic a long-tail batch: most 100-600 tokens, one 1500 (the padding the batched SDPA pays).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.attention.backend import LayerAttentionOptions, make_attention_backend  # noqa: E402
from gpu_runtime.attention.metadata import AttentionMetadata, DecodeBatch, PlanRow  # noqa: E402

NUM_KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE, NUM_PAGES = 4, 2, 64, 16, 8192
BACKENDS = ("torch", "batched", "cpu_paged")


def milliseconds(fn, repeats: int = 30) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - started) / repeats * 1e3, 3)


def decode_metadata(lengths: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
    """What gpu_runtime/step_inputs.py builds for a decode-only step over these contexts."""
    max_context = int(lengths.max())
    last = lengths - 1
    slots = tables.gather(1, (last // PAGE_SIZE)[:, None]).squeeze(1) * PAGE_SIZE + last % PAGE_SIZE
    rows = tuple(PlanRow(i, 1, int(n), tables[i, : -(-int(n) // PAGE_SIZE)].tolist()) for i, n in enumerate(lengths))
    decode = DecodeBatch(slice(0, len(lengths)), tables, lengths, max_context, rows)
    return AttentionMetadata(slot_mapping=slots, decode=decode)  # each backend's plan() derives its masks or spans


def measure(batch: int, generator: torch.Generator) -> dict:
    k_pages = torch.randn(NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    v_pages = torch.randn(NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    lengths = torch.randint(100, 600, (batch,), generator=generator)
    lengths[0] = 1500
    max_pages = -(-int(lengths.max()) // PAGE_SIZE)
    tables = torch.stack([torch.randperm(NUM_PAGES, generator=generator)[:max_pages] for _ in range(batch)])
    q = torch.randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=generator)
    new_k = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    meta = decode_metadata(lengths, tables)
    options = LayerAttentionOptions.default(HEAD_DIM)
    row: dict = {"batch": batch}
    outputs = {}
    for name in BACKENDS:
        backend = make_attention_backend(name, torch.device("cpu"))
        backend.plan(meta)  # once per step, as the runner does: one layer's call is what is timed
        forward = functools.partial(backend.forward, q, new_k, new_k, k_pages, v_pages, meta, options)
        outputs[name] = forward()
        row[f"{name}_ms"] = milliseconds(forward)
    for name in BACKENDS[1:]:
        row[f"{name}_over_torch"] = round(row[f"{name}_ms"] / row["torch_ms"], 2)
        row[f"{name}_max_abs_difference"] = float((outputs[name] - outputs["torch"]).abs().max())
    return row


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = [measure(batch, generator) for batch in (1, 4, 16, 64)]
    print(json.dumps({"torch_threads": torch.get_num_threads(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
