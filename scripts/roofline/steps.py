"""Timings of one decode step three ways: the engine's, the weights-only matmul chain's, and the roofline bound."""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.kv_cache.kv_pool import page_bytes
from gpu_runtime.model.config import ModelConfig, load_model_config
from gpu_runtime.model.cpu_weights import dense_weight
from roofline.machine import best_seconds, synchronize
from roofline.shapes import DUMMY_WEIGHT_SHAPES

_WARM_STEPS = 2
_engines: dict[str, LLM] = {}  # one engine per attention backend, sized for the largest point


def engine_and_chain_ms(model_dir, backend: str, batch: int, context: int, args) -> tuple[float, float, float, LLM]:
    """Median milliseconds of LLMEngine.step() while `batch` sequences decode at about `context` tokens, of the
    weights-only chain at the same batch, and of the same chain through the engine's own linear layers (prepacked
    for oneDNN on a CPU; on a GPU the same kernels as the plain chain), timed in turns (a step, then each chain) so
    that all see the same machine: on a shared 2-core box its speed drifts by tens of percent between seconds.

    Prompts of `context` random tokens are prefilled first (untimed); the timed steps are decode-only.
    """
    llm = _engine(model_dir, backend, args)
    engine = llm.engine
    rng = random.Random(batch * 100_003 + context)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=_WARM_STEPS + args.steps + 2, temperature=0, ignore_eos=True)
    ids = [f"{backend}-{batch}-{context}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(context)], params)
    started_decoding: set[str] = set()
    while len(started_decoding) < batch:  # prefill, in as many chunks as the token budget needs
        started_decoding.update(delta.request_id for delta in engine.step())
    for _ in range(_WARM_STEPS):
        engine.step()
    chain = weights_only_chain(engine.runner.model, batch)
    own_chain = engines_linears_chain(engine.runner.model, batch)
    device = engine.device
    step_times, chain_times, own_chain_times = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        engine.step()  # its sampler reads the tokens back: the step is complete on any device
        step_times.append(time.perf_counter() - started)
        chain_times.append(best_seconds(chain, device, repeats=1))
        own_chain_times.append(best_seconds(own_chain, device, repeats=1))
    for request_id in ids:
        engine.abort_request(request_id)
    medians = [statistics.median(times) * 1e3 for times in (step_times, chain_times, own_chain_times)]
    return *medians, llm


def _engine(model_dir, backend: str, args) -> LLM:
    if backend not in _engines:
        batch, context = max(_ints(args.batches)), max(_ints(args.contexts))
        config = load_model_config(model_dir)
        dtype = getattr(torch, args.dtype)
        tokens_per_seq = context + _WARM_STEPS + args.steps + 32
        pages = batch * -(-tokens_per_seq // 16) + 16
        options = dict(
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=batch,
            max_num_batched_tokens=max(4096, batch),
            kv_cache_bytes=pages * page_bytes(config, 16, dtype),
            enable_prefix_caching=False,
            attention_backend=backend,
        )
        if args.shape in DUMMY_WEIGHT_SHAPES:
            options["load_format"] = "dummy"
        _engines[backend] = LLM(str(model_dir), **options)
    return _engines[backend]


def weights_only_chain(model, batch: int):
    """The decode step's matmuls alone, on the model's own weights: q/k/v, o, gate/up, down per layer, LM head.

    Each matmul's input is a preallocated contiguous tensor of the right shape: nothing but the kernels runs.
    """
    weights = []
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        weights += [dense_weight(linear) for linear in linears]
    weights.append(dense_weight(model.lm_head))
    device, dtype = weights[0].device, weights[0].dtype
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=device, dtype=dtype) for w in weights}

    def chain():
        with torch.inference_mode():
            for weight in weights:
                F.linear(inputs[weight.shape[1]], weight)

    return chain


def engines_linears_chain(model, batch: int):
    """The weights-only chain through the engine's own linear modules (their layout, their kernels)."""
    linears = []
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears += [attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj]
    linears.append(model.lm_head)
    weight = model.embed_tokens.weight
    inputs = {linear.in_features: torch.randn(batch, linear.in_features, device=weight.device, dtype=weight.dtype)
              for linear in linears}  # fmt: skip

    def chain():
        with torch.inference_mode():
            for linear in linears:
                linear(inputs[linear.in_features])

    return chain


def decode_bound(config: ModelConfig, dtype: torch.dtype, batch: int, context: int, limits: dict) -> dict:
    """The step's floor: every weight and every cached K/V byte read once, or every FLOP at GEMM peak."""
    element = torch.empty((), dtype=dtype).element_size()
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 2 * hidden * inter + inter * hidden
    matmul_params = config.num_layers * per_layer + config.vocab_size * hidden
    weight_bytes = matmul_params * element
    kv_bytes = batch * context * config.kv_elements_per_token * element
    flops = 2 * matmul_params * batch + 4 * batch * context * config.num_layers * q_size
    bytes_ms = (weight_bytes + kv_bytes) / (limits["bandwidth_gb_s"] * 1e9) * 1e3
    flops_ms = flops / (limits["gemm_gflops"] * 1e9) * 1e3
    return {
        "bound_ms": max(bytes_ms, flops_ms),
        "bound_by": "bandwidth" if bytes_ms >= flops_ms else "compute",
        "weight_mb": round(weight_bytes / 1e6, 1),
        "kv_mb": round(kv_bytes / 1e6, 1),
        "gflop": round(flops / 1e9, 3),
    }


def profile_one_step(model_dir, backend: str, batch: int, context: int, args) -> dict:
    """Kernel launches, host-device synchronisations and attention calls in one decode step, from the profiler."""
    llm = _engine(model_dir, backend, args)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{i}", [(i + j) % 200 for j in range(context)], params)
    scheduler = engine.scheduler
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in scheduler.waiting + scheduler.running):
        engine.step()
    engine.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.device(args.device).type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(torch.device(args.device))
    with torch.profiler.profile(activities=activities) as profiler:
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    counts: dict[str, int] = {}
    for event in profiler.events():
        counts[event.name] = counts.get(event.name, 0) + 1

    def count(matches) -> int:
        return sum(n for name, n in counts.items() if matches(name))

    return {
        "batch": batch,
        "context": context,
        "kernel_launches": count(lambda name: name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")),
        "synchronizations": count(lambda name: "Synchronize" in name or name == "cudaMemcpy"),
        "attention_calls": count(lambda name: name in ("aten::scaled_dot_product_attention", "tokend::paged_decode")),
        "aten_ops": count(lambda name: name.startswith("aten::")),
    }


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]
