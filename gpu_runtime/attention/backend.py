"""The attention backend interface and the choice between the implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from gpu_runtime.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its page pool, then attends every new query over its pages."""

    name: str

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


def make_attention_backend(name: str = "torch") -> AttentionBackend:
    """Returns the backend called `name`; "torch" is the portable one that runs everywhere."""
    from gpu_runtime.attention.torch_paged import TorchPagedAttention

    backends = {"torch": TorchPagedAttention}
    if name not in backends:
        raise ValueError(f"attention_backend: {name!r} is not one of {sorted(backends)}")
    return backends[name]()
