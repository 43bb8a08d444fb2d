"""tokend's GPU runtime: the model, the paged KV cache, and the continuous-batching engine.

The names below load on first use, so that torch-free parts (the IPC messages, the tokenizer) can be
imported by the frontend without pulling torch into its process.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "gpu_runtime.llm",
    "CompletionOutput": "gpu_runtime.outputs",
    "EngineConfig": "gpu_runtime.engine_config",
    "FinishReason": "gpu_runtime.ipc.enums",
    "LLMEngine": "gpu_runtime.engine",
    "Priority": "gpu_runtime.ipc.enums",
    "RequestDelta": "gpu_runtime.ipc.messages",
    "RequestOutput": "gpu_runtime.outputs",
    "SamplingParams": "gpu_runtime.ipc.sampling_params",
    "TokenLogprob": "gpu_runtime.ipc.messages",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpu_runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
