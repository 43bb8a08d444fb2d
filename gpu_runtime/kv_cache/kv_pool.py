"""The preallocated K/V page tensors of every layer (how many pages: gpu_runtime/memory_profile.py)."""

from __future__ import annotations

import torch

from gpu_runtime.model.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers, K and V together."""
    return config.kv_elements_per_token * page_size * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per layer, one [num_pages, page_size, num_kv_heads, head_dim] tensor for K and one for V."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device):
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
