"""The attention backend interface (a per-step plan, then a per-layer forward), the per-layer options, and the
factory that makes a backend by its name (the names: catalog.py)."""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from gpu_runtime.attention.catalog import backend_entry
from gpu_runtime.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class LayerAttentionOptions:
    """How one layer attends, as its model family says: Mistral's window, Gemma's soft-cap and query scale. The
    model builds one per layer; a backend checks once, as the model is built, that it can run them."""

    scale: float  # multiplies q.k before the softmax
    sliding_window: int | None = None  # a query sees itself and the sliding_window - 1 positions before it
    logit_softcap: float | None = None  # scores become logit_softcap * tanh(scores / logit_softcap)

    @classmethod
    def default(cls, head_dim: int) -> LayerAttentionOptions:
        # 1 / sqrt(d), as SDPA computes its default scale: the same double, so passing it changes no bit.
        return cls(scale=1.0 / math.sqrt(head_dim))

    @property
    def is_plain(self) -> bool:
        """Full causal attention with nothing on the scores but the scale."""
        return self.sliding_window is None and self.logit_softcap is None


class AttentionBackend(ABC):
    """Writes a layer's new K/V into its page pool, then attends every new query over its pages.

    Once per step the runner calls `plan` with the step's metadata, before the forward: the backend derives there
    whatever its kernels read in every layer (SDPA masks, per-sequence spans; a kernel library's plan and its
    buffers), and owns it. Then `forward` runs once per layer with that same metadata and the layer's options."""

    name: str
    # Whether its forward reads a KV group's pages from the metadata it is given (a hybrid model's groups each have
    # their own block table: AttentionMetadata.other_groups), rather than from buffers its plan filled.
    reads_group_tables: bool = True

    @classmethod
    def create(cls, device: torch.device) -> AttentionBackend:
        """The backend for `device`; ValueError saying why it cannot run there."""
        return cls()

    def check_options(self, options: LayerAttentionOptions) -> None:
        """Raises ValueError naming what this backend cannot do (this default: plain attention only)."""
        if options.sliding_window is not None:
            raise ValueError(
                f"attention_backend: {self.name} has no sliding-window attention (torch, batched, cpu_paged have)"
            )
        if options.logit_softcap is not None:
            raise ValueError(
                f"attention_backend: {self.name} has no logit soft-capping (torch, batched, cpu_paged have)"
            )

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepares the step `meta` describes, for every layer's forward; called once per step, before them."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_pages: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim], this layer's pool
        v_pages: torch.Tensor,
        meta: AttentionMetadata,  # the step's, as given to `plan`
        options: LayerAttentionOptions,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def require_planned(state, meta: AttentionMetadata, backend: str):
    """`state`, what a backend's plan derived, if it was derived from this step's `meta` (any KV group's); else
    RuntimeError (a forward without its step's plan would read another step's masks)."""
    if state is None or state.meta is not meta.step:
        raise RuntimeError(f"attention backend {backend}: forward before plan(meta) for this step")
    return state


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called `name` (catalog.py lists them), for `device`; "auto" is the fastest that is exact here:
    on CUDA batched; on a CPU cpu_paged, or where its kernel cannot be built, torch (on a CPU the padded, masked SDPA
    of batched costs more than a call per sequence once context lengths differ: scripts/bench_attention.py)."""
    if name == "auto" and device.type != "cpu":
        name = "batched"
    elif name == "auto":
        from gpu_runtime.attention.cpu_kernel import load_cpu_kernel

        name = "cpu_paged" if load_cpu_kernel() is not None else "torch"
    module, _, cls = backend_entry(name).implementation.partition(":")
    return getattr(importlib.import_module(module), cls).create(device)
