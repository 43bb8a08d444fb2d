"""This machine's two ceilings for a decode step: GEMM throughput and memory bandwidth, both measured."""

from __future__ import annotations

import time

import torch


def machine_limits(device: torch.device, dtype: torch.dtype) -> dict:
    return {
        "gemm_gflops": round(gemm_gflops(device, dtype), 1),
        "bandwidth_gb_s": round(copy_bandwidth_gb_s(device), 1),
    }


def gemm_gflops(device: torch.device, dtype: torch.dtype) -> float:
    """The best of a few large square matmuls: the peak a decode step's matmuls could approach."""
    n = 8192 if device.type == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = best_seconds(lambda: torch.mm(a, b), device, repeats=5)
    return 2 * n**3 / seconds / 1e9


def copy_bandwidth_gb_s(device: torch.device) -> float:
    """Bytes read plus bytes written per second by a tensor copy far larger than any cache."""
    numel = (2 << 30 if device.type == "cuda" else 256 << 20) // 4
    source = torch.ones(numel, device=device)
    target = torch.empty_like(source)
    seconds = best_seconds(lambda: target.copy_(source), device, repeats=5)
    return 2 * numel * 4 / seconds / 1e9


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` timed runs after one warm-up run (the least disturbed by other work)."""
    fn()
    synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
