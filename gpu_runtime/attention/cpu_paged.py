"""The CPU's fastest backend: decodes through the C++ kernel that reads K/V in place in the page pool, prompt
chunks through the batched torch path (prefill is compute-bound: its matmuls, not the reading, decide).

The kernel does plain attention (a scale, the whole context); a layer with soft-capped logits (Gemma's), or a sliding
window some decode of the step reaches past, decodes through the batched path instead, which honours both, so every
option is served here."""

from __future__ import annotations

import torch

from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, require_planned
from gpu_runtime.attention.batched import StepMasks, decode_attention, prefill_attention
from gpu_runtime.attention.metadata import AttentionMetadata
from gpu_runtime.attention.pages import write_pages


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"

    def __init__(self, kernel):
        self._paged_decode = kernel  # gpu_runtime.attention.cpu_kernel.load_cpu_kernel()
        self._masks: StepMasks | None = None

    @classmethod
    def create(cls, device: torch.device) -> CpuPagedAttention:
        from gpu_runtime.attention.cpu_kernel import load_cpu_kernel

        if device.type != "cpu":
            raise ValueError(f"attention_backend: cpu_paged runs on the CPU only, not on {device}")
        kernel = load_cpu_kernel()
        if kernel is None:
            raise ValueError("attention_backend: cpu_paged's kernel could not be built here (see the message above)")
        return cls(kernel)

    def check_options(self, options: LayerAttentionOptions) -> None:
        pass  # the kernel runs plain layers; the others decode through the batched path

    def plan(self, meta: AttentionMetadata) -> None:
        self._masks = StepMasks(meta)  # the kernel needs no mask: the prompt chunks do, and the non-plain decodes

    def forward(self, q, k, v, k_pages, v_pages, meta: AttentionMetadata, options: LayerAttentionOptions):
        masks = require_planned(self._masks, meta, self.name)
        write_pages(k, v, k_pages, v_pages, meta.slot_mapping)
        decode = meta.decode
        if decode is not None:
            queries = q[decode.rows]
            if _is_plain_for(options, decode.max_context):
                decoded = self._paged_decode(
                    queries, k_pages, v_pages, decode.block_table, decode.context_lens, options.scale
                )
            else:  # a window or soft-capped logits: the batched path's decode, which honours them
                decoded = decode_attention(queries, k_pages, v_pages, decode, masks.decode(options.sliding_window),
                                           options)  # fmt: skip
            if meta.prefill is None and decoded.shape[0] == q.shape[0]:  # a decode-only step: nothing to merge
                return decoded
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if decode is not None:
            out[decode.rows] = decoded
        if meta.prefill is not None:
            rows = meta.prefill.rows
            out[rows] = prefill_attention(q, k[rows], v[rows], k_pages, v_pages, meta.prefill,
                                          masks.prefill(options.sliding_window), options)  # fmt: skip
        return out


def _is_plain_for(options: LayerAttentionOptions, max_context: int) -> bool:
    """Whether the layer attends plainly over contexts up to `max_context`: a window that long or longer hides
    nothing (Mistral 7B v0.1's 4,096 over a shorter conversation), so the kernel's whole context is exact."""
    window = options.sliding_window
    return options.logit_softcap is None and (window is None or window >= max_context)
