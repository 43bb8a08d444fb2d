"""The CPU's fastest backend: decodes through the C++ kernel that reads K/V in place in the page pool, prompt
chunks through the batched torch path (prefill is compute-bound: its matmuls, not the reading, decide)."""

from __future__ import annotations

import torch

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.attention.batched import prefill_attention
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.attention.pages import write_pages


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    uses_spans = False

    def __init__(self, kernel):
        self._paged_decode = kernel  # gpu_runtime.attention.cpu_kernel.load_cpu_kernel()

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata) -> torch.Tensor:
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.decode is not None:
            decode = meta.decode
            queries = q[decode.rows].contiguous()
            scale = q.shape[-1] ** -0.5
            out[decode.rows] = self._paged_decode(
                queries, k_pages, v_pages, decode.block_table, decode.context_lens, scale
            )
        if meta.prefill is not None:
            rows = meta.prefill.rows
            out[rows] = prefill_attention(q, k[rows], v[rows], k_pages, v_pages, meta.prefill)
        return out
