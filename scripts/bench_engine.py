"""Engine benchmark: continuous batching vs static batching vs transformers, one process, one workload.

Prints one JSON object. Usage:  .venv/bin/python scripts/bench_engine.py [--num-requests 256] [--batch-size 16]
The workload is the engine issue's long tail: prompts of 32-512 tokens, output lengths exponential with mean
128 capped at 1024, ignore_eos, on a random ~30M-parameter Llama in float32. All three runs generate exactly
the same useful tokens, so their throughputs compare like for like.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime import LLM, SamplingParams  # noqa: E402
from gpu_runtime.default_model import byte_level_tokenizer  # noqa: E402

MODEL_SHAPE = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)


def write_bench_model(directory: Path, seed: int = 0, **overrides) -> int:
    """Saves the random benchmark Llama (MODEL_SHAPE with `overrides`) with transformers, plus the byte-level
    tokenizer; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = {**MODEL_SHAPE, **overrides}
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=256, eos_token_id=257)).float()
    model.save_pretrained(directory)
    byte_level_tokenizer().save(str(directory / "tokenizer.json"))
    return sum(p.numel() for p in model.parameters())


def long_tail_workload(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) pairs; reproducible from the seed."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(MODEL_SHAPE["vocab_size"]) for _ in range(rng.randint(32, 512))]
        output_len = min(1024, max(1, round(rng.expovariate(1 / 128))))
        requests.append((prompt, output_len))
    return requests


def emit_json(result: dict, path: Path | None) -> None:
    """Prints the benchmark's result as JSON, and writes it to `path` too when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        path.write_text(text + "\n")


def log(message: str) -> None:
    print(f"[bench_engine] {message}", file=sys.stderr, flush=True)


def run_tokend(model_dir: Path, requests, batch_size: int, scheduling: str) -> dict:
    log(f"tokend {scheduling} batching, batch size {batch_size}")
    llm = LLM(str(model_dir), max_num_seqs=batch_size, scheduling=scheduling, kv_cache_bytes=2 << 30)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.engine.stats.__init__()
    llm.engine.runner.forward_seconds = 0.0
    prompts = [{"prompt_token_ids": prompt} for prompt, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == sum(n for _, n in requests), "every request must generate exactly its output length"
    stats = llm.engine.stats
    return {
        "seconds": round(seconds, 3),
        "output_tokens": generated,
        "output_tokens_per_s": round(generated / seconds, 1),
        "engine_efficiency": round(stats.forward_seconds / seconds, 4),
        # Steps with any prompt tokens cost the same prefill work in every mode; the rest is pure decode.
        "prefill_step_seconds": round(stats.prefill_step_seconds, 3),
        "decode_only_seconds": round(stats.step_seconds - stats.prefill_step_seconds, 3),
        "peak_kv_waste": round(stats.peak_kv_waste, 4),
        "peak_used_pages": stats.peak_used_pages,
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
    }


def decode_step_ms_by_batch(model_dir: Path, batch_sizes=(1, 4, 16), context: int = 300) -> dict[str, float]:
    """Milliseconds per decode step at each batch size: how a step's cost grows with the batch.

    On a GPU a decode step costs about the same at batch 1 and 16, which is what makes a static batch's
    shrinking tail expensive; on a 2-core CPU it does not, and this table shows by how much.
    """
    llm = LLM(str(model_dir), max_num_seqs=max(batch_sizes), kv_cache_bytes=1 << 30)
    engine = llm.engine
    result = {}
    for batch in batch_sizes:
        for i in range(batch):
            params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
            engine.add_request(f"{batch}-{i}", [(7 * i + j) % 256 for j in range(context)], params)
        engine.step()  # the prefill
        for _ in range(3):
            engine.step()
        started = time.perf_counter()
        for _ in range(20):
            engine.step()
        result[str(batch)] = round((time.perf_counter() - started) / 20 * 1e3, 2)
        while engine.has_unfinished_requests():
            engine.step()
    return result


def run_transformers(model_dir: Path, requests, batch_size: int) -> dict:
    """transformers generate in static batches: left-padded prompts, each batch runs to its longest output."""
    from transformers import AutoModelForCausalLM

    log(f"transformers generate, static batches of {batch_size}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # ignore_eos
    model.generation_config.pad_token_id = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            model.generate(ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch), do_sample=False)
    seconds = time.perf_counter() - started
    useful = sum(n for _, n in requests)
    return {"seconds": round(seconds, 3), "output_tokens": useful, "output_tokens_per_s": round(useful / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()

    requests = long_tail_workload(args.num_requests, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        num_params = write_bench_model(model_dir)
        result = {
            "workload": {
                "num_requests": args.num_requests,
                "batch_size": args.batch_size,
                "seed": args.seed,
                "prompt_tokens": sum(len(p) for p, _ in requests),
                "output_tokens": sum(n for _, n in requests),
                "model_parameters": num_params,
                "dtype": "float32",
                "torch_threads": torch.get_num_threads(),
            },
            "continuous": run_tokend(model_dir, requests, args.batch_size, "continuous"),
            "static": run_tokend(model_dir, requests, args.batch_size, "static"),
            "decode_step_ms_by_batch": decode_step_ms_by_batch(model_dir),
        }
        if not args.skip_transformers:
            result["transformers_static"] = run_transformers(model_dir, requests, args.batch_size)
    continuous = result["continuous"]["output_tokens_per_s"]
    result["ratios"] = {"continuous_over_static": round(continuous / result["static"]["output_tokens_per_s"], 2)}
    if "transformers_static" in result:
        hf = result["transformers_static"]["output_tokens_per_s"]
        result["ratios"]["continuous_over_transformers"] = round(continuous / hf, 2)
    emit_json(result, args.json_out)


if __name__ == "__main__":
    main()
