"""SchedulerConfig and EngineConfig: every knob of one engine, validated, with defaults that work on a laptop.

Torch-free msgspec Structs, so that one object goes from `tokend serve`'s flags and TOML file to the engine
unchanged: the daemon builds and checks it before any process starts, ships it to the scheduler process as
JSON, and the engine and scheduler read it there. Each field's description is its `--help` text.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

from common.checks import is_int, is_number, require
from gpu_runtime.attention.catalog import ATTENTION_BACKEND_CHOICES, ATTENTION_BACKEND_HELP

DTYPES = ("float32", "bfloat16", "float16")
# The tool-call formats the frontend reads (frontend/tool_calls/choice.py READERS), and auto: the template's.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
ATTENTION_BACKENDS = ATTENTION_BACKEND_CHOICES  # the backends' one table: gpu_runtime/attention/catalog.py


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the continuous-batching scheduler needs: batch limits, chunking, and the latency targets."""

    max_num_seqs: Annotated[int, _doc("sequences in the running batch at most")] = 64
    max_num_batched_tokens: Annotated[int, _doc("tokens one forward step computes at most")] = 4096
    scheduling: Annotated[
        Literal["continuous", "static"],
        _doc("continuous batching, or static (a batch keeps its shape until its last member ends; a baseline)"),
    ] = "continuous"
    enable_chunked_prefill: Annotated[
        bool, _doc("split long prompts across steps, so running streams keep decoding beside them")
    ] = True
    ttft_slo_ms: Annotated[
        float | None, _doc("hold the batch depth so that a new prompt's first token comes within this (ms)")
    ] = None
    itl_slo_ms: Annotated[
        float | None, _doc("hold each step's token budget so that running streams keep this pace (ms)")
    ] = None

    def __post_init__(self) -> None:
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, key)
            require(is_int(value) and value >= 1, key, "an integer >= 1", value)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} cannot carry one token for each of "
                f"max_num_seqs={self.max_num_seqs} sequences; raise max_num_batched_tokens or lower max_num_seqs"
            )
        require(self.scheduling in ("continuous", "static"), "scheduling", "continuous|static", self.scheduling)
        chunked = self.enable_chunked_prefill
        require(isinstance(chunked, bool), "enable_chunked_prefill", "true|false", chunked)
        for key in ("ttft_slo_ms", "itl_slo_ms"):
            value = getattr(self, key)
            ok = value is None or (is_number(value) and value > 0)
            require(ok, key, "a positive number of milliseconds, or unset", value)


class EngineConfig(SchedulerConfig, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine: which model on which device, its KV cache, and (inherited) its scheduler's knobs."""

    model: Annotated[str | None, _doc("a Hugging Face checkpoint directory; unset serves the embedded model")] = None
    served_model_name: Annotated[str | None, _doc("the name clients use; default: the directory's name")] = None
    device: Annotated[str, _doc("auto (cuda when present, else cpu), cpu, cuda, cuda:N")] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        _doc(
            "weights, activations and KV cache; auto: float32 on CPU; on CUDA the checkpoint's torch_dtype, float32 "
            "served as bfloat16, bfloat16 as float16 on GPUs without it (as vLLM)"
        ),
    ] = "auto"
    max_model_len: Annotated[int | None, _doc("caps the checkpoint's context length (tokens)")] = None
    page_size: Annotated[int, _doc("tokens per KV-cache page (a power of two)")] = 16
    kv_cache_bytes: Annotated[
        int | None,
        _doc(
            "KV-cache size in bytes (never more than max_num_seqs full-length sequences use; each rank's under tensor "
            "parallelism); unset: 512 MiB on CPU, on CUDA what gpu_memory_utilization leaves"
        ),
    ] = None
    gpu_memory_utilization: Annotated[
        float,
        _doc(
            "the share of the GPU's total memory this engine may take, in (0, 1]: the KV cache gets it less the "
            "weights and the activation peak of a profiled largest step (as vLLM); give each engine on a GPU its part"
        ),
    ] = 0.9
    enable_prefix_caching: Annotated[bool, _doc("requests that share a prefix share its cached KV pages")] = True
    kv_offload_bytes: Annotated[
        int,
        _doc(
            "host memory for a second KV tier, in bytes (0: none; each rank's under tensor parallelism): cached "
            "prefix pages the KV cache evicts are copied there and loaded back when a prompt needs them again, "
            "instead of recomputed (pinned memory on CUDA; models whose layers all attend globally)"
        ),
    ] = 0
    disable_hybrid_kv_cache_manager: Annotated[
        bool,
        _doc(
            "as vLLM's flag: a model mixing sliding-window and global layers (Gemma 2 and 3) keeps every page for "
            "every layer (one block table) instead of a block table per group of layers, the sliding groups giving "
            "back the pages behind the window; prefill and decode workers always do (their handover moves one table)"
        ),
    ] = False
    attention_backend: Annotated[Literal[ATTENTION_BACKENDS], _doc(ATTENTION_BACKEND_HELP)] = "auto"
    tensor_parallel_size: Annotated[
        int,
        _doc(
            "split the model over this many ranks (Megatron's way): the group's GPUs on CUDA (one each), processes "
            "on a CPU; rank 0 is the scheduler process and starts the others"
        ),
    ] = 1
    load_format: Annotated[
        Literal["auto", "dummy"],
        _doc("auto: the checkpoint's safetensors; dummy: random weights of its shape, for benchmarks (as vLLM's)"),
    ] = "auto"
    quantization: Annotated[
        Literal["auto", "none"],
        _doc(
            "GGUF weights: auto (the default) serves the blocks the file holds (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) as "
            "they are, multiplied in place by the CPU kernel where it can (a CPU in float32, one rank; elsewhere "
            "dequantized at load): a seventh of the memory, batch-1 decode ~4x faster (docs/BENCHMARKS.md); none "
            "dequantizes them to float32 at conversion (the path transformers' outputs are checked against)"
        ),
    ] = "auto"
    generation_config: Annotated[
        str,
        _doc(
            "sampling defaults for the fields a request leaves unset, as vLLM's flag: auto (the checkpoint's "
            "generation_config.json), vllm (none: temperature 1, no filters), or a directory holding one"
        ),
    ] = "auto"
    chat_template: Annotated[
        str | None,
        _doc(
            "a chat template file (jinja) overriding the checkpoint's chat_template.jinja and tokenizer_config.json "
            "ones, as vLLM's flag"
        ),
    ] = None
    tool_call_parser: Annotated[
        Literal["auto", "hermes", "llama3_json", "mistral"],
        _doc(
            "how tool_choice auto reads the model's calls out of its text, as vLLM's flag: auto (the format the chat "
            "template writes), hermes, llama3_json or mistral (docs/tool-calls.md)"
        ),
    ] = "auto"
    # Check the page pool's invariants whenever the engine goes idle (TOKEND_DEBUG=1 turns it on).
    debug_checks: bool = msgspec.field(default_factory=lambda: os.environ.get("TOKEND_DEBUG") == "1")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.dtype == "auto" or self.dtype in DTYPES, "dtype", f"auto|{'|'.join(DTYPES)}", self.dtype)
        require(isinstance(self.device, str) and bool(self.device), "device", "a device name", self.device)
        size = self.page_size
        require(is_int(size) and size >= 1 and not size & (size - 1), "page_size", "a power of two", size)
        budget = self.kv_cache_bytes
        require(budget is None or (is_int(budget) and budget > 0), "kv_cache_bytes", "a positive integer", budget)
        share = self.gpu_memory_utilization
        require(is_number(share) and 0 < share <= 1, "gpu_memory_utilization", "in (0, 1]", share)
        length = self.max_model_len
        require(length is None or (is_int(length) and length >= 2), "max_model_len", "an integer >= 2", length)
        offload = self.kv_offload_bytes
        require(is_int(offload) and offload >= 0, "kv_offload_bytes", "a number of bytes >= 0", offload)
        caching = self.enable_prefix_caching
        require(isinstance(caching, bool), "enable_prefix_caching", "true|false", caching)
        backend = self.attention_backend
        require(backend in ATTENTION_BACKENDS, "attention_backend", "|".join(ATTENTION_BACKENDS), backend)
        tp = self.tensor_parallel_size
        require(is_int(tp) and tp >= 1, "tensor_parallel_size", "an integer >= 1", tp)
        require(self.load_format in ("auto", "dummy"), "load_format", "auto|dummy", self.load_format)
        require(self.quantization in ("auto", "none"), "quantization", "auto|none", self.quantization)
        generation = self.generation_config
        require(isinstance(generation, str) and bool(generation), "generation_config", "auto|vllm|DIR", generation)
        template = self.chat_template
        require(template is None or (isinstance(template, str) and bool(template)), "chat_template", "a file", template)
        parser = self.tool_call_parser
        require(parser in TOOL_CALL_PARSERS, "tool_call_parser", "|".join(TOOL_CALL_PARSERS), parser)
