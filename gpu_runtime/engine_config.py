"""EngineConfig: every knob of one engine, validated, with defaults that work on a laptop."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None  # a Hugging Face checkpoint directory; None serves the embedded default
    served_model_name: str | None = None  # the name clients use; defaults to the directory's name
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # cuda when present, else cpu
    page_size: int = 16  # tokens per KV page
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int | None = None  # KV pool size; None: 512 MiB on CPU, a share of free memory on CUDA
    gpu_memory_utilization: float = 0.9  # that share
    max_model_len: int | None = None  # caps the checkpoint's context length
    scheduling: str = "continuous"  # "static" exists only as the benchmark baseline
    enable_prefix_caching: bool = True  # requests sharing a prefix share its cached pages
    enable_chunked_prefill: bool = True  # long prompts are split across steps, decodes go first
    ttft_slo_ms: float | None = None  # time-to-first-token target the batch depth is held to
    itl_slo_ms: float | None = None  # inter-token latency target each step's token budget is held to
    attention_backend: str = "torch"
    # Check the page pool's invariants whenever the engine goes idle (TOKEND_DEBUG=1 turns it on).
    debug_checks: bool = field(default_factory=lambda: os.environ.get("TOKEND_DEBUG") == "1")

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.page_size, int) or self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size: must be a power of two, got {self.page_size!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes: must be positive, got {self.kv_cache_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device: {self.device!r} is not a torch device ({error})") from None

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
