"""The preallocated K/V page tensors of every layer (how many pages: gpu_runtime/memory_profile.py)."""

from __future__ import annotations

import torch

from gpu_runtime.kv_cache.kv_groups import KVLayout
from gpu_runtime.model.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype, layout: KVLayout | None = None) -> int:
    """Bytes one page takes, K and V together: across all layers, or one KV group's layers under `layout`."""
    num_layers = layout.layers_per_group if layout is not None else config.num_layers
    per_layer = config.kv_elements_per_token // config.num_layers
    return per_layer * num_layers * page_size * torch.empty((), dtype=dtype).element_size()


class KVPool:
    """Per layer, one [num_pages, page_size, num_kv_heads, head_dim] tensor for K and one for V.

    Under a layout of several KV groups (gpu_runtime/kv_cache/kv_groups.py) the groups' layers share the tensors: the
    i-th layer of every group reads and writes the i-th pair, each group at the pages of its own block table."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device,
                 layout: KVLayout | None = None):  # fmt: skip
        self.layout = layout or KVLayout.single(config.num_layers)
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        shared = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.layout.layers_per_group)
        ]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [shared[slot] for slot in self.layout.slot_of_layer()]
