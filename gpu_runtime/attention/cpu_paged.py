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
        decode = meta.decode
        if decode is not None:
            decoded = self._paged_decode(
                q[decode.rows], k_pages, v_pages, decode.block_table, decode.context_lens, q.shape[-1] ** -0.5
            )
            if meta.prefill is None and decoded.shape[0] == q.shape[0]:  # a decode-only step: nothing to merge
                return decoded
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decode is not None:
            out[decode.rows] = decoded
        if meta.prefill is not None:
            rows = meta.prefill.rows
            out[rows] = prefill_attention(q, k[rows], v[rows], k_pages, v_pages, meta.prefill)
        return out
