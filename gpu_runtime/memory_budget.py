"""How many KV pages an engine gets: pure arithmetic, so that it is tested with given numbers.

On CUDA, as vLLM: `gpu_memory_utilization` of the device's total memory, less the weights, the activation peak of
the largest step (measured by a profiling run, gpu_runtime/memory_profile.py) and the memory this process holds
outside PyTorch; on a CPU, an explicit byte budget. Either way no more pages than the running batch can ever
fill (`max_num_seqs` sequences of `max_model_len` tokens): more would only lengthen the page lists and the
integrity check, and on a large GPU push the K/V tensors past 2^31 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"


def max_useful_pages(max_num_seqs: int, max_model_len: int, page_size: int) -> int:
    """The pages a full running batch of full-length sequences holds: more are never used at once."""
    return max_num_seqs * -(-max_model_len // page_size)


def pages_from_device_memory(
    *,
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    peak_activation_bytes: int,
    page_bytes: int,
    max_pages: int,
    non_torch_bytes: int = 0,
) -> int:
    """floor((utilization x total - weights - activation peak - non-torch) / page_bytes), at most `max_pages`;
    ValueError naming gpu_memory_utilization when not one page is left."""
    usable = int(gpu_memory_utilization * total_bytes)
    left = usable - weights_bytes - peak_activation_bytes - non_torch_bytes
    if left < page_bytes:
        raise ValueError(
            f"gpu_memory_utilization: {gpu_memory_utilization} of the device's {_gib(total_bytes)} is "
            f"{_gib(usable)}; the weights take {_gib(weights_bytes)}, the largest step's activations "
            f"{_gib(peak_activation_bytes)} and memory outside PyTorch {_gib(non_torch_bytes)}, leaving "
            f"{_gib(max(left, 0))}: not one KV page ({page_bytes} bytes). Raise gpu_memory_utilization, lower "
            f"max_num_batched_tokens, or serve a smaller model"
        )
    return min(left // page_bytes, max_pages)


def pages_from_budget(budget_bytes: int, page_bytes: int, page_size: int, max_pages: int) -> int:
    """An explicit budget's pages, at most `max_pages`; ValueError naming kv_cache_bytes when it holds none."""
    if budget_bytes < page_bytes:
        raise ValueError(
            f"kv_cache_bytes: {budget_bytes} bytes hold no page of {page_size} tokens ({page_bytes} bytes each)"
        )
    return min(budget_bytes // page_bytes, max_pages)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What the engine decided at start (LLMEngine.memory), for its ready log and the operator."""

    weights_bytes: int  # parameters and buffers, as materialised
    peak_activation_bytes: int  # the profiled largest step's; 0 where no profiling run was made
    non_torch_bytes: int  # CUDA memory this process took outside PyTorch's allocator while starting
    page_bytes: int  # one page across all layers (a KV group's layers, where there are several), K and V
    num_pages: int
    max_useful_pages: int  # the cap: max_num_seqs x ceil(max_model_len / page_size), in each KV group

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def as_log_fields(self) -> dict[str, int]:
        """Flat key/values for a structlog event."""
        return {
            "weights_bytes": self.weights_bytes,
            "peak_activation_bytes": self.peak_activation_bytes,
            "non_torch_bytes": self.non_torch_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_pages": self.num_pages,
            "kv_pages_cap": self.max_useful_pages,
        }
