"""Starting a scheduler's engine on its device, and naming what went wrong when it cannot start.

The daemon gave this process its GPUs through CUDA_VISIBLE_DEVICES; the engine's device is "cuda:0" among them.
A start that fails on the device (no CUDA in this torch, no driver, out of memory) fails the same way on every
retry, so the worker exits EXIT_CONFIG_ERROR with a message naming the device and what was asked, and the daemon
stops instead of restarting it in a loop.
"""

from __future__ import annotations

import os

import msgspec
import torch

from common.lanes import Role
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.worker.spec import WorkerSpec

# Test hook, for tests only: a CPU-only machine plays a GPU box. The worker does everything a CUDA scheduler does
# up to set_device, then runs its engine on the CPU, so the tests can check the GPU placement of a real daemon.
TEST_CUDA_AS_CPU = "TOKEND_TEST_CUDA_AS_CPU"

# What may fail on the device while the engine starts: CUDA and driver errors and torch.OutOfMemoryError are
# RuntimeErrors; a CPU-only torch asserts ("Torch not compiled with CUDA enabled").
DEVICE_START_ERRORS = (RuntimeError, AssertionError)


def engine_config_on_device(spec: WorkerSpec) -> EngineConfig:
    """The engine config to start with, after making its CUDA device the current one (set_device). A prefill or
    decode worker keeps one block table for every layer: its KV handover moves one table's pages."""
    config = spec.engine
    if spec.role is not Role.MIXED:
        config = msgspec.structs.replace(config, disable_hybrid_kv_cache_manager=True)
    if not config.device.startswith("cuda"):
        return config
    if os.environ.get(TEST_CUDA_AS_CPU) == "1":
        return msgspec.structs.replace(config, device="cpu")
    if torch.version.cuda is None:
        raise RuntimeError(f"this torch ({torch.__version__}) was built without CUDA; serve with device = cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is usable here (is the NVIDIA driver loaded, and the GPU visible?)")
    torch.cuda.set_device(torch.device(config.device))
    return config


def start_failure(spec: WorkerSpec, error: BaseException) -> dict[str, object]:
    """The log fields of a failed start: the device, what was asked of it, and the error."""
    config = spec.engine
    if config.kv_cache_bytes is not None:
        kv_budget = f"kv_cache_bytes={config.kv_cache_bytes}"
    else:
        kv_budget = f"gpu_memory_utilization={config.gpu_memory_utilization:g}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = config.device
    if config.device.startswith("cuda"):
        where += f" (CUDA_VISIBLE_DEVICES={visible}, configured as {spec.devices})"
    model = config.served_model_name or config.model or "the default model"
    kind = "out of memory" if isinstance(error, torch.OutOfMemoryError) else type(error).__name__
    message = (
        f"cannot start {model} on {where} with dtype {config.dtype}, {kv_budget}, max_num_batched_tokens="
        f"{config.max_num_batched_tokens}, max_num_seqs={config.max_num_seqs}: {kind}: {str(error)[:500]}"
    )
    return {
        "message": message,
        "device": config.device,
        "cuda_visible_devices": visible,
        "model": config.model,
        "dtype": config.dtype,
        "kv_budget": kv_budget,
        "error_type": type(error).__name__,
        "error": str(error)[:500],
    }
