"""The attention backends by name: the one table the engine config's choices and help, and the factory, read.

Torch-free on purpose: the daemon validates an EngineConfig (and prints its --help) before any process has torch.
Each entry names the class that implements it (imported only when the backend is made); adding a backend is its
module plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BackendEntry:
    name: str  # attention_backend's value
    implementation: str  # "module:Class", an AttentionBackend whose `create(device)` builds it
    help: str  # its part of attention_backend's --help


BACKENDS = (
    BackendEntry(
        "batched",
        "gpu_runtime.attention.batched:BatchedPagedAttention",
        "plain torch, any device: one call per step for the decodes, one for the prompt chunks",
    ),
    BackendEntry(
        "cpu_paged",
        "gpu_runtime.attention.cpu_paged:CpuPagedAttention",
        "a C++ decode kernel reading the pages in place, CPU only",
    ),
    BackendEntry(
        "torch", "gpu_runtime.attention.torch_paged:TorchPagedAttention", "one call per sequence: the reference"
    ),
    BackendEntry(
        "triton",
        "gpu_runtime.attention.triton_paged:TritonPagedAttention",
        "Triton kernels reading the pages in place (split-KV decode, varlen prefill), CUDA only",
    ),
)
AUTO_HELP = "cpu_paged on a CPU, torch there if the kernel cannot be built, batched on CUDA"

BACKEND_NAMES = tuple(entry.name for entry in BACKENDS)
ATTENTION_BACKEND_CHOICES = ("auto", *BACKEND_NAMES)
ATTENTION_BACKEND_HELP = "the attention kernels, all over the paged cache: " + ", ".join(
    [f"{entry.name} ({entry.help})" for entry in BACKENDS] + [f"auto ({AUTO_HELP})"]
)


def backend_entry(name: str) -> BackendEntry:
    """The entry called `name` (not "auto"); ValueError listing the choices otherwise."""
    for entry in BACKENDS:
        if entry.name == name:
            return entry
    raise ValueError(f"attention_backend: {name!r} is not one of {', '.join(ATTENTION_BACKEND_CHOICES)}")
