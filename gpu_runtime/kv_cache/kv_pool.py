"""The preallocated K/V page tensors of every layer, sized from a memory budget."""

from __future__ import annotations

import torch

from gpu_runtime.model.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers, K and V together."""
    return config.kv_elements_per_token * page_size * torch.empty((), dtype=dtype).element_size()


def kv_budget_bytes(device: torch.device, kv_cache_bytes: int | None, gpu_memory_utilization: float) -> int:
    """The bytes the KV pool may take: the explicit budget, else a share of the accelerator's free memory.

    On CUDA this is called after the weights are loaded, so "free" already excludes them.
    """
    if kv_cache_bytes is not None:
        return kv_cache_bytes
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * gpu_memory_utilization)
    return 512 * 1024 * 1024  # a laptop-friendly CPU default


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

    @classmethod
    def from_budget(cls, config: ModelConfig, budget_bytes: int, page_size: int, dtype, device) -> KVPool:
        num_pages = budget_bytes // page_bytes(config, page_size, dtype)
        if num_pages < 1:
            raise ValueError(
                f"kv_cache_bytes: {budget_bytes} bytes hold no page of {page_size} tokens "
                f"({page_bytes(config, page_size, dtype)} bytes each)"
            )
        return cls(config, num_pages, page_size, dtype, device)
