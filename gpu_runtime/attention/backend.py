"""The attention backend interface and the choice between the implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gpu_runtime.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its page pool, then attends every new query over its pages."""

    name: str
    uses_spans: bool  # whether it reads the metadata's per-sequence spans (built only for backends that do)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], this layer's pool
        v_pages: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name`, for `device`:
    - "batched": plain torch, any device; one call per step for the decodes and one for the prompt chunks;
    - "cpu_paged": the CPU's C++ decode kernel reading K/V in place, and batched prompt chunks;
    - "torch": plain torch, any device, one call per sequence: the reference the others are checked against;
    - "auto": the fastest that is exact here: on CUDA batched; on a CPU cpu_paged, or where its kernel cannot be
      built, torch (on a CPU the padded, masked SDPA of batched costs more than a call per sequence once context
      lengths differ: scripts/bench_attention.py).
    """
    from gpu_runtime.attention.batched import BatchedPagedAttention
    from gpu_runtime.attention.cpu_kernel import load_cpu_kernel
    from gpu_runtime.attention.cpu_paged import CpuPagedAttention
    from gpu_runtime.attention.torch_paged import TorchPagedAttention

    if name == "auto" and device.type != "cpu":
        name = "batched"
    elif name == "auto":
        name = "cpu_paged" if load_cpu_kernel() is not None else "torch"
    if name == "cpu_paged":
        if device.type != "cpu":
            raise ValueError(f"attention_backend: cpu_paged runs on the CPU only, not on {device}")
        kernel = load_cpu_kernel()
        if kernel is None:
            raise ValueError("attention_backend: cpu_paged's kernel could not be built here (see the message above)")
        return CpuPagedAttention(kernel)
    backends = {"batched": BatchedPagedAttention, "torch": TorchPagedAttention}
    if name not in backends:
        raise ValueError(f"attention_backend: {name!r} is not one of auto, batched, cpu_paged, torch")
    return backends[name]()
