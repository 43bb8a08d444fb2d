"""The GPU check's sections (gpu/run.py runs each in its own process): each takes the device and whether
this is the CPU dry run, and returns its JSON fields. A measurement that needs CUDA is {"skipped": why} on the CPU.

The engine is compared with transformers, the library that defines the architectures, on checkpoints it wrote
itself (gpu/models.py).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

from gpu import models

ROOT = Path(__file__).resolve().parents[2]

CUDA_ONLY = "a CUDA measurement: skipped in the CPU dry run"
BF16_PROMPTS = 12


# -- sections -------------------------------------------------------------------------------------------------------


def environment(device: str, dry_run: bool) -> dict:
    import importlib.metadata
    import platform

    versions = {}
    for name in ("transformers", "safetensors", "tokenizers", "msgspec", "structlog", "numpy", "pytest"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    result = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "packages": versions,
        "missing": sorted(name for name, version in versions.items() if version is None),
        "hint": None
        if versions["msgspec"] and versions["structlog"]
        else "the engine imports msgspec and structlog: "
        "bring their wheels in .whl/ (scripts/gpu_check.sh installs them into a temporary directory)",
        "dry_run": dry_run,
        "device": device,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        result.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_total_bytes=total,
            memory_free_bytes=free,
            device_count=torch.cuda.device_count(),
        )
    return result


def exactness_fp32(device: str, dry_run: bool) -> dict:
    """fp32 greedy tokens equal transformers' on the same device, for a Llama (GQA) and a Qwen2 checkpoint."""
    prompts, num_tokens = (
        (models.prompts(3, 1, 40, seed=11), 8) if dry_run else (models.prompts(8, 1, 200, seed=11), 24)
    )
    results = {}
    for kind in ("llama", "qwen2"):
        model_dir = models.checkpoint(kind)
        llm = models.llm(model_dir, device, dtype="float32", max_num_seqs=8)
        ours = models.generate(llm, prompts, models.greedy(num_tokens))
        del llm
        models.release()
        reference = models.transformers_greedy(
            models.transformers(model_dir, torch.float32, device), prompts, num_tokens, device
        )
        equal = [a == b for a, b in zip(ours, reference, strict=True)]
        results[kind] = {"prompts": len(prompts), "tokens": num_tokens, "equal": sum(equal)}
    return {"ok": all(r["equal"] == r["prompts"] for r in results.values()), "models": results}


def agreement_bf16(device: str, dry_run: bool) -> dict:
    """bfloat16 against transformers bfloat16 over 12 prompts (4 in the dry run). transformers runs over the prompt
    and our greedy tokens: a prompt agrees when its argmax is our token at every position; the largest gap between
    its logprob of our token and ours is reported. Whole generate() continuations are compared too, for the
    record: its cached decode rounds differently from its full forward, so they may part at a near tie.

    The bar (11 of 12 prompts) is for CUDA's kernels; on the CPU, whose bfloat16 kernels round otherwise, the dry
    run asks only that most positions agree (a broken path agrees on almost none)."""
    count, num_tokens = (4, 8) if dry_run else (BF16_PROMPTS, 16)
    model_dir = models.checkpoint("llama")  # the GPU tests' model (tests/test_gpu.py)
    prompts = models.prompts(count, 4, 120, seed=21)
    llm = models.llm(model_dir, device, dtype="bfloat16", max_num_seqs=count)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], models.greedy(num_tokens, logprobs=0))
    ours = [o.outputs[0].token_ids for o in outputs]
    our_logprobs = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outputs]
    del llm, outputs
    models.release()
    model = models.transformers(model_dir, torch.bfloat16, device)
    reference = models.transformers_greedy(model, prompts, num_tokens, device)
    agreeing_prompts = agreeing_positions = 0
    max_delta = 0.0
    with torch.inference_mode():
        for prompt, tokens, logprobs in zip(prompts, ours, our_logprobs, strict=True):
            logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1 : -1].float()
            chosen = logits.log_softmax(-1).gather(1, torch.tensor(tokens, device=device)[:, None]).squeeze(1)
            agree = int((logits.argmax(-1).cpu() == torch.tensor(tokens)).sum())
            agreeing_positions += agree
            agreeing_prompts += agree == len(tokens)
            max_delta = max(max_delta, (chosen.cpu() - torch.tensor(logprobs)).abs().max().item())
    return {
        "ok": agreeing_positions >= 0.75 * count * num_tokens if dry_run else agreeing_prompts >= count - 1,
        "prompts": count,
        "tokens": num_tokens,
        "prompts_top1_agreeing": agreeing_prompts,
        "top1_agreement": round(agreeing_positions / (count * num_tokens), 4),
        "max_abs_delta_logprob": round(max_delta, 5),
        "generate_continuations_equal": sum(a == b for a, b in zip(ours, reference, strict=True)),
    }


def cached_and_chunked(device: str, dry_run: bool) -> dict:
    """The same greedy tokens with prefix caching off, on (the second run hits the cache) and chunked prefill
    (a 64-token budget, 16 in the dry run) as from one plain run, in float32."""
    model_dir = models.checkpoint("llama")
    shared_len, count, budget = (40, 3, 16) if dry_run else (150, 6, 64)
    shared = models.prompts(1, shared_len, shared_len, seed=31)[0]
    prompts = [shared + tail for tail in models.prompts(count, 1, 40, seed=32)]
    params = models.greedy(8 if dry_run else 20)
    plain = models.llm(model_dir, device, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=4096)
    expected = models.generate(plain, prompts, params)
    del plain
    models.release()
    cached = models.llm(model_dir, device, dtype="float32", enable_prefix_caching=True)
    first = models.generate(cached, prompts, params)
    again = cached.generate([{"prompt_token_ids": p} for p in prompts], params)
    hits = sum(o.num_cached_tokens for o in again)
    del cached
    models.release()
    chunking = dict(enable_prefix_caching=False, max_num_batched_tokens=budget, max_num_seqs=budget)
    chunked = models.llm(model_dir, device, dtype="float32", **chunking)
    pieces = models.generate(chunked, prompts, params)
    del chunked
    models.release()
    cache_equal = first == expected and [o.outputs[0].token_ids for o in again] == expected
    return {
        "ok": cache_equal and pieces == expected and hits > 0,
        "prefix_cache_equal": cache_equal,
        "cached_prompt_tokens": hits,
        "chunked_equal": pieces == expected,
    }


def seeds(device: str, dry_run: bool) -> dict:
    """A seeded request samples the same tokens alone and in a batch; in float32, on the device as on the CPU."""
    from gpu_runtime import SamplingParams

    model_dir = models.checkpoint("llama")
    num_tokens = 8 if dry_run else 24
    seeded = SamplingParams(max_tokens=num_tokens, temperature=0.8, top_p=0.95, seed=42, ignore_eos=True)
    others = SamplingParams(max_tokens=num_tokens, temperature=1.0, ignore_eos=True)
    prompt, mates = models.prompts(1, 30, 30, seed=41)[0], models.prompts(7, 5, 60, seed=42)
    llm = models.llm(model_dir, device, dtype="float32", max_num_seqs=8)
    alone = models.generate(llm, [prompt], seeded)[0]
    in_batch = models.generate(llm, mates[:3] + [prompt] + mates[3:], [others] * 3 + [seeded] + [others] * 4)[3]
    del llm
    models.release()
    result = {"alone_equals_in_batch": alone == in_batch, "distinct_tokens": len(set(alone))}
    if dry_run:
        result["cpu_equals_device"] = {"skipped": CUDA_ONLY}
        return {"ok": alone == in_batch, **result}
    cpu = models.generate(models.llm(model_dir, "cpu", dtype="float32"), [prompt], seeded)[0]
    result["cpu_equals_device"] = cpu == alone
    return {"ok": alone == in_batch and cpu == alone, **result}


def decode(device: str, dry_run: bool) -> dict:
    """Decode ms/step from scripts/bench_roofline.py (the attention work's benchmark), run as it is documented."""
    script = ROOT / "scripts" / "bench_roofline.py"
    if not script.exists():
        return {"skipped": "scripts/bench_roofline.py is not there yet"}
    if dry_run:
        flags = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--batches", "1,4", "--contexts", "64"]
        flags += ["--steps", "3"]  # the dry run proves the path, not the figures
    else:
        flags = ["--device", "cuda", "--dtype", "bfloat16", "--shape", "8b", "--batches", "1,16,64"]
        flags += ["--contexts", "256", "--profile-step"]
    done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=230)
    if done.returncode != 0:
        return {"ok": False, "command": flags, "error": done.stderr[-2000:]}
    report = json.loads(done.stdout[done.stdout.index("{") :])
    rows = [
        {key: row.get(key) for key in ("batch", "context", "engine_ms", "chain_ms", "bound_ms")}
        for row in report.get("decode", [])
    ]
    for row in rows:
        if row["engine_ms"] and row["bound_ms"]:
            row["engine_over_bound"] = round(row["engine_ms"] / row["bound_ms"], 2)
    return {"ok": bool(rows), "command": flags, "decode": rows, "machine": report.get("machine"),
            "profile": report.get("profile", {"skipped": CUDA_ONLY} if dry_run else None)}  # fmt: skip


def loader_memory(device: str, dry_run: bool) -> dict:
    """Peak device memory while loading a 1.5B-shaped bfloat16 checkpoint (random weights) against what the loaded
    model holds: the loader builds on the meta device and fills the weights in place, so about 1x (plus one
    checkpoint tensor in flight)."""
    from gpu_runtime.attention.backend import make_attention_backend
    from gpu_runtime.engine_config import EngineConfig
    from gpu_runtime.model.config import load_model_config
    from gpu_runtime.model.loader import load_model

    shape = "tiny" if dry_run else "1.5b"
    with tempfile.TemporaryDirectory(prefix="loader-", dir=models.work_dir()) as tmp:
        started = time.perf_counter()
        model_dir, weight_bytes = models.write_bf16_checkpoint(Path(tmp), models.LOADER_SHAPES[shape])
        written_s = time.perf_counter() - started
        backend = make_attention_backend(EngineConfig().attention_backend, torch.device(device))
        if not dry_run:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if not dry_run else 0
        started = time.perf_counter()
        model = load_model(model_dir, load_model_config(model_dir), backend, torch.bfloat16, torch.device(device))
        load_s = time.perf_counter() - started
        result = {"shape": shape, "checkpoint_bytes": weight_bytes, "write_s": round(written_s, 2),
                  "load_s": round(load_s, 2)}  # fmt: skip
        if dry_run:
            return {"ok": True, **result, "peak_bytes": {"skipped": CUDA_ONLY}}
        peak = torch.cuda.max_memory_allocated() - before
        held = torch.cuda.memory_allocated() - before
        del model
        models.release()
    ratio = peak / held  # held: the model as materialised (an untied lm_head counts), checkpoint_bytes: the file's
    return {"ok": ratio < 1.25, **result, "peak_bytes": peak, "held_bytes": held, "peak_over_held": round(ratio, 3)}


def large_pool(device: str, dry_run: bool) -> dict:
    """An engine whose K/V tensors pass 2^31 elements each (over a million pages) starts in seconds and serves the
    same greedy tokens as one with a small pool. Scaled down in the dry run."""
    from gpu_runtime.kv_cache.kv_pool import page_bytes
    from gpu_runtime.model.config import load_model_config

    model_dir = models.checkpoint(
        "llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=131072
    )
    dtype_name, budget = ("float32", 64 << 20) if dry_run else ("bfloat16", 20 << 30)
    dtype = getattr(torch, dtype_name)
    prompts, params = (
        (models.prompts(2, 10, 30, seed=51), models.greedy(6))
        if dry_run
        else (models.prompts(4, 10, 80, seed=51), models.greedy(16))
    )
    small = models.llm(model_dir, device, dtype=dtype_name, kv_cache_bytes=16 << 20)
    expected = models.generate(small, prompts, params)
    del small
    models.release()
    started = time.perf_counter()
    big = models.llm(model_dir, device, dtype=dtype_name, kv_cache_bytes=budget, max_num_seqs=256)
    start_s = time.perf_counter() - started
    config = load_model_config(model_dir)
    pages = big.engine.kv.num_pages
    elements = pages * page_bytes(config, 16, dtype) // (2 * config.num_layers * dtype.itemsize)
    served = models.generate(big, prompts, params)
    del big
    models.release()
    result = {"kv_cache_bytes": budget, "pages": pages, "elements_per_k_tensor": elements, "start_s": round(start_s, 2)}
    passed = served == expected and (dry_run or elements > 2**31)
    return {
        "ok": passed,
        "scaled_down": dry_run,
        **result,
        "past_2_31": elements > 2**31,
        "tokens_equal": served == expected,
    }


def sampler(device: str, dry_run: bool) -> dict:
    """ms per sampler call at batch 64 over a 128,256-token vocabulary (scripts/bench_sampler.py's settings), and
    on CUDA the synchronisations each call makes (torch's sync debug mode counts them)."""
    from scripts import bench_sampler  # the repository root is on the path: scripts/ is a namespace package

    batch, vocab = (4, 8000) if dry_run else (64, 128256)
    dev = torch.device(device)
    args = SimpleNamespace(prompt_len=512, output_len=256)
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)).to(dev) * 4
    results, syncs = {}, {}
    instance = bench_sampler.Sampler()
    for name, params in bench_sampler.SETTINGS.items():
        rows = [params] * batch if params is not None else bench_sampler.mixed_params(batch)
        seqs = bench_sampler.make_seqs(rows, args, vocab, dev)
        call = functools.partial(_sample_copy, instance, logits, seqs)
        results[name] = bench_sampler.milliseconds_per_call(call, dev, 1 if dry_run else 10)
        syncs[name] = _syncs_per_call(call) if dev.type == "cuda" else None
    return {"ok": True, "batch": batch, "vocab": vocab, "ms_per_call": results,
            "syncs_per_call": syncs if dev.type == "cuda" else {"skipped": CUDA_ONLY}}  # fmt: skip


def _sample_copy(instance, logits: torch.Tensor, seqs: list) -> None:
    instance(logits.clone(), seqs)  # the sampler adjusts its logits in place: a fresh copy each call, as the engine's


def _syncs_per_call(call) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def two_schedulers(device: str, dry_run: bool) -> dict:
    """Two engines on one device, each given gpu_memory_utilization 0.4 (their pools sized from it on CUDA), both
    start and serve, one after the other and interleaved."""
    from gpu_runtime import LLM

    # Wide K/V (8 heads of 64) and long contexts: 0.4 of an H200 is ~870 k pages here, below the pool's cap
    # (max_num_seqs x max_model_len), so each pool is sized by its share of the device, not by the cap.
    shape = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=131072)
    model_dir = models.checkpoint("llama", **shape)
    options = dict(device=device, gpu_memory_utilization=0.4, max_num_seqs=256)
    if dry_run:
        options["kv_cache_bytes"] = 32 << 20
    first = LLM(str(model_dir), **options)
    second = LLM(str(model_dir), **options)
    num_tokens = 6 if dry_run else 12
    prompts, params = models.prompts(2 if dry_run else 4, 5, 50, seed=61), models.greedy(num_tokens)
    a, b = models.generate(first, prompts, params), models.generate(second, prompts, params)
    result = {"pages": [first.engine.kv.num_pages, second.engine.kv.num_pages], "same_tokens": a == b}
    if not dry_run:
        result["memory_allocated_bytes"] = torch.cuda.memory_allocated()
        result["memory_total_bytes"] = torch.cuda.mem_get_info()[1]
    del first, second
    models.release()
    return {"ok": a == b and all(len(t) == num_tokens for t in a), **result}


def tensor_parallel(device: str, dry_run: bool) -> dict:
    """scripts/bench_tensor_parallel.py: the decode step at tensor_parallel_size 1 and 2 and the collectives' share
    of it; on CUDA only where the box has two GPUs (the dry run: two CPU rank processes, a tiny model)."""
    if not dry_run and torch.cuda.device_count() < 2:
        return {"skipped": f"tensor_parallel_size 2 needs two GPUs; this box has {torch.cuda.device_count()}"}
    if dry_run:
        flags = ["--device", "cpu", "--dtype", "float32", "--shape", "tiny", "--batches", "1", "--steps", "2"]
    else:
        flags = ["--device", "cuda", "--dtype", "bfloat16", "--shape", "8b", "--batches", "1,16,64"]
    script = ROOT / "scripts" / "bench_tensor_parallel.py"
    done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=170)
    if done.returncode != 0:
        return {"ok": False, "command": flags, "error": done.stderr[-2000:]}
    report = json.loads(done.stdout[done.stdout.index("{") :])
    return {"ok": bool(report["rows"]), "command": flags, "rows": report["rows"]}


def kv_offload(device: str, dry_run: bool) -> dict:
    """scripts/bench_kv_offload.py: revisited prefixes' TTFT with the host KV tier (pinned host memory, its copy
    stream) over without it, and the no-reuse throughput ratio (the dry run: a small pool on the CPU)."""
    flags = ["--device", "cpu", "--quick", "--pool-pages", "32"] if dry_run else ["--device", "cuda"]
    script = ROOT / "scripts" / "bench_kv_offload.py"
    done = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True, timeout=400)
    if done.returncode != 0:
        return {"ok": False, "command": flags, "error": done.stderr[-2000:]}
    report = json.loads(done.stdout[done.stdout.index("{") :])
    figures = {key: report[key] for key in ("revisit_ttft_p50_on_over_off", "no_reuse_throughput_on_over_off")}
    loaded = report["multi_turn"]["on"]["host_pages_loaded"]
    return {"ok": loaded > 0, "command": flags, **figures, "host_pages_loaded": loaded}


def gpu_tests(device: str, dry_run: bool) -> dict:
    """The marked GPU tests (TOKEND_TEST_GPU=1 pytest -m gpu), counted from pytest's JUnit report."""
    import os
    import xml.etree.ElementTree as ElementTree

    with tempfile.TemporaryDirectory(prefix="pytest-", dir=models.work_dir()) as tmp:
        report = Path(tmp) / "report.xml"
        # Only the files that mark GPU tests: collecting the whole suite takes longer than running these.
        files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py") if _marks_gpu(f))
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={report}", *files]  # fmt: skip
        env = {**os.environ, "TOKEND_TEST_GPU": "1"}
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
        if not report.exists():
            return {"ok": False, "exit_code": done.returncode, "error": (done.stdout + done.stderr)[-2000:]}
        suite = ElementTree.parse(report).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    ok = done.returncode in (0, 5) and counts["failures"] == counts["errors"] == 0
    return {"ok": ok, "exit_code": done.returncode, **counts, "failed": failed[:20],
            "summary": done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []}  # fmt: skip


def _marks_gpu(path: Path) -> bool:
    return "mark.gpu" in path.read_text(errors="replace")


SECTIONS = {
    "environment": environment,
    "exactness_fp32": exactness_fp32,
    "agreement_bf16": agreement_bf16,
    "cached_and_chunked": cached_and_chunked,
    "seeds": seeds,
    "decode": decode,
    "loader_memory": loader_memory,
    "large_pool": large_pool,
    "sampler": sampler,
    "two_schedulers": two_schedulers,
    "tensor_parallel": tensor_parallel,
    "kv_offload": kv_offload,
    "gpu_tests": gpu_tests,
}
