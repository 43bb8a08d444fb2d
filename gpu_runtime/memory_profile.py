"""Loads the model and sizes its KV pool: on CUDA from a profiling run of the largest step the scheduler can issue
(vLLM's way), elsewhere from the explicit byte budget; the arithmetic is gpu_runtime/memory_budget.py's."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu_runtime.attention.backend import AttentionBackend
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.kv_groups import KVLayout, kv_layout
from gpu_runtime.kv_cache.kv_pool import KVPool, page_bytes
from gpu_runtime.memory_budget import (
    MemoryPlan,
    max_useful_pages,
    pages_from_budget,
    pages_from_device_memory,
)
from gpu_runtime.model.config import ModelConfig
from gpu_runtime.model.cpu_weights import can_prepack, prepack_linears
from gpu_runtime.model.llama import layer_windows, place_kv_groups
from gpu_runtime.model.loader import load_model
from gpu_runtime.model.registry import CausalLM
from gpu_runtime.model.tensor_parallel import TensorParallel
from gpu_runtime.model_runner import ModelRunner
from gpu_runtime.sampler import Sampler
from gpu_runtime.scheduler import PrefillWork, SchedulerOutput
from gpu_runtime.sequence import BlockTable, Sequence
from gpu_runtime.tp.step_channel import StepChannel

CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # kv_cache_bytes' default off CUDA: laptop-friendly

# The costliest sampling a request can ask for: a copy of the logits for logprobs, penalties over the prompt, a
# nucleus over the whole vocabulary (top-p without top-k). The profiling run samples every row this way, so its
# peak covers the sampler's too.
_COSTLIEST_SAMPLING = SamplingParams(
    max_tokens=1, temperature=1.0, top_p=0.9, min_p=0.05, logprobs=20, repetition_penalty=1.1,
    presence_penalty=0.5, frequency_penalty=0.5,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepShape:
    """A step to profile: each prompt chunk as (tokens already cached, new tokens), and single-token decodes."""

    prefills: tuple[tuple[int, int], ...]
    num_decodes: int = 0
    decode_context: int = 1  # tokens each decode already has in the cache


def largest_steps(config: EngineConfig, max_model_len: int) -> list[StepShape]:
    """The steps whose activation peaks bound every step the scheduler can issue; the profile runs each.

    - the most tokens: `max_num_batched_tokens` over `max_num_seqs` fresh prompts, as vLLM profiles;
    - the longest attention: one prompt's last chunk, its context max_model_len, beside a full batch of decodes
      of max_model_len contexts too (a batched backend gathers every decode's context padded to the longest).
      Unchunked or static, a prompt longer than the token budget runs whole rather than never: that chunk is then
      the whole prompt, so such configs start with a smaller pool rather than being refused. (A static batch
      prefills all its prompts in one step, whatever the budget: beyond one full-length prompt it is not covered.)
    """
    budget, num_seqs = config.max_num_batched_tokens, config.max_num_seqs
    base, extra = divmod(budget, num_seqs)
    spread = [min(base + 1, max_model_len)] * extra + [min(base, max_model_len)] * (num_seqs - extra)
    runs_whole = not config.enable_chunked_prefill or config.scheduling == "static"
    last_chunk = max_model_len if runs_whole else min(budget, max_model_len)
    return [
        StepShape(tuple((0, n) for n in spread)),
        StepShape(((max_model_len - last_chunk, last_chunk),), num_seqs - 1, decode_context=max_model_len - 1),
    ]


def build_step(
    shape: StepShape, model: CausalLM, model_config: ModelConfig, config: EngineConfig, dtype, device
) -> tuple[ModelRunner, SchedulerOutput]:
    """`shape` as real sequences over a temporary pool just large enough (its cached K/V zeros, in the model's KV
    groups), and the real runner."""
    layout = kv_layout_of(model, hybrid=not config.disable_hybrid_kv_cache_manager)
    page_size = config.page_size
    pages = itertools.count()
    vocab = model_config.vocab_size
    prefills = []
    for index, (cached, new) in enumerate(shape.prefills):
        prompt = [t % vocab for t in range(cached + new)]
        seq = _profile_sequence(f"profile-prefill-{index}", prompt, model_config)
        seq.num_computed_tokens = cached
        seq.page_ids = [next(pages) for _ in range(-(-(cached + new) // page_size))]
        prefills.append(PrefillWork(seq, new))
        seq.tables += [BlockTable(seq.page_ids) for _ in range(1, layout.num_groups)]  # which pages does not matter
    decodes = []
    decode_prompt = [t % vocab for t in range(shape.decode_context)]
    # Long decodes all read the same pages (what they hold does not matter, only how many are read).
    decode_pages = [next(pages) for _ in range(-(-(shape.decode_context + 1) // page_size))]
    for index in range(shape.num_decodes):
        seq = _profile_sequence(f"profile-decode-{index}", decode_prompt, model_config)
        seq.output_token_ids.append((index + 1) % vocab)
        seq.num_computed_tokens = shape.decode_context  # its prompt is cached: this step computes one output token
        seq.tables = [BlockTable(decode_pages) for _ in range(layout.num_groups)]
        decodes.append(seq)
    pool = KVPool(model_config, next(pages), page_size, dtype, device, layout)
    return ModelRunner(model, pool, device), SchedulerOutput(decodes=decodes, prefills=prefills)


def run_step(runner: ModelRunner, step: SchedulerOutput) -> list[int]:
    """One forward and one sampling, as LLMEngine.step runs them; returns the sampled tokens."""
    inputs = runner.prepare(step)
    logits, _ = runner.execute(inputs)
    if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
        return []
    tokens, _logprobs = Sampler()(logits, inputs.sampling)
    return tokens


def _profile_sequence(request_id: str, prompt: list[int], model_config: ModelConfig) -> Sequence:
    return Sequence(
        request_id=request_id,
        prompt_token_ids=prompt,
        params=_COSTLIEST_SAMPLING,
        max_model_len=model_config.max_model_len,
        eos_token_ids=frozenset(),
    )


@dataclass(frozen=True, slots=True)
class _CudaUsage:
    """The device's free memory and PyTorch's share of it, at one moment."""

    free: int
    reserved: int

    @classmethod
    def now(cls, device: torch.device) -> _CudaUsage:
        return cls(torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device))

    def grown_outside_torch(self, later: _CudaUsage) -> int:
        """What this process took since, beside PyTorch's allocator (lazily loaded kernels, library handles); a
        neighbour loading at the same moment can only make it larger, so the pool errs small."""
        return max(0, (self.free - later.free) - (later.reserved - self.reserved))


def profiled_activation_bytes(
    model: CausalLM, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype, device
) -> int:
    """The most memory any of the largest steps allocates beyond the weights (and its temporary pool); what they
    allocated is then freed and handed back to the device."""
    peaks = []
    for shape in largest_steps(config, model_config.max_model_len):
        peaks.append(_peak_of(shape, model, model_config, config, dtype, device))
        torch.cuda.empty_cache()  # the step's blocks, now free, must not count as used when the pool is sized
    return max(peaks)


def _peak_of(shape: StepShape, model, model_config, config, dtype, device) -> int:
    runner, step = build_step(shape, model, model_config, config, dtype, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run_step(runner, step)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def kv_layout_of(model: CausalLM, hybrid: bool = True) -> KVLayout:
    """The model's KV groups (gpu_runtime/kv_cache/kv_groups.py): a group per kind of layer where the model mixes
    sliding and global layers, `hybrid` allows it and its attention backend reads each group's block table; else
    one group."""
    return kv_layout(layer_windows(model), hybrid=hybrid and model.attention_backend.reads_group_tables)


def model_bytes(model: torch.nn.Module) -> int:
    """Parameters and buffers, each shared tensor once (tied embeddings, the layers' one rotary table)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def load_model_and_pool(
    model_dir: Path,
    model_config: ModelConfig,
    config: EngineConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel | None = None,
    channel: StepChannel | None = None,
) -> tuple[CausalLM, KVPool, MemoryPlan]:
    """The loaded model, its KV pool, and the numbers that sized the pool.

    Under tensor parallelism (`tp`, and the group's `channel`) this rank's shard and pool: every rank of the group
    runs this at once, the profiling steps' collectives pairing up, and the pool holds as many pages on every rank
    (the fewest any rank's memory allows), each page this rank's KV heads only."""
    measures_device = device.type == "cuda" and config.kv_cache_bytes is None
    start = _CudaUsage.now(device) if measures_device else None
    model = load_model(model_dir, model_config, backend, dtype, device, config.load_format, tp)
    if channel is not None:
        channel.barrier()  # all shards loaded: a slow load must not time out the profiling step's collectives
    if can_prepack(device, dtype):
        prepack_linears(model)
    model_config = model.config  # the rank's view under tensor parallelism: its KV heads size its pages
    weights = model_bytes(model)
    layout = kv_layout_of(model, hybrid=not config.disable_hybrid_kv_cache_manager)
    place_kv_groups(model, layout)
    per_page = page_bytes(model_config, config.page_size, dtype, layout)  # one group's layers
    cap = max_useful_pages(config.max_num_seqs, model_config.max_model_len, config.page_size) * layout.num_groups
    peak = non_torch = 0
    if start is not None:
        peak = profiled_activation_bytes(model, model_config, config, dtype, device)
        non_torch = start.grown_outside_torch(_CudaUsage.now(device))
        num_pages = pages_from_device_memory(
            total_bytes=torch.cuda.mem_get_info(device)[1],
            gpu_memory_utilization=config.gpu_memory_utilization,
            weights_bytes=weights,
            peak_activation_bytes=peak,
            non_torch_bytes=non_torch,
            page_bytes=per_page,
            max_pages=cap,
        )
    else:
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else CPU_KV_CACHE_BYTES
        num_pages = pages_from_budget(budget, per_page, config.page_size, cap)
    if channel is not None:
        num_pages = channel.smallest(num_pages)
    pool = KVPool(model_config, num_pages, config.page_size, dtype, device, layout)
    plan = MemoryPlan(weights, peak, non_torch, per_page, num_pages, cap)
    return model, pool, plan
