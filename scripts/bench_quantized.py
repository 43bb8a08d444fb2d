"""The default model's GGUF served four ways on one CPU thread: tokend quantized (blocks kept, the kernel of
gpu_runtime/quant, the default), the same with the decode path's x kept in float32 (its way before int16), tokend
float32 (quantization "none"), and llama.cpp (llama-cpp-python, if a Python with it is given: install it in a
separate venv, never tokend's). Prints JSON; --output writes it, --plot a chart.

Measured: batch-1 ms per output token over 128 greedy tokens after a 200-word prompt (the decode steps only, first
token excluded); 16 concurrent streams' output tokens/s (16 such prompts, distinct, all at once, prefill included;
llama.cpp's server runs them one after another, so it is 16 sequential generations); resident weight bytes (tokend:
the scheduler's parameters and buffers, MemoryPlan.weights_bytes; llama.cpp: the GGUF's tensor data, mapped).

    .venv/bin/python scripts/bench_quantized.py --llama-python /tmp/bench-venv/bin/python \\
        --output docs/benchmarks/quantized.json --plot docs/benchmarks/quantized.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

NUM_TOKENS, NUM_STREAMS, PROMPT_WORDS = 128, 16, 200
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards",
          "quietly", "hum", "jazz", "near", "big", "old", "trees"]  # fmt: skip


def prompt(index: int) -> str:
    """A 200-word prompt, a different one per stream (no shared prefix for the cache to reuse)."""
    return " ".join(_WORDS[(index * 7 + i * (index + 1)) % len(_WORDS)] for i in range(PROMPT_WORDS))


def bench_tokend(quantization: str, activation_bits: int | None = None) -> dict:
    """`activation_bits`: the decode path's rounding of x (gpu_runtime/quant/linear.py), where not its default."""
    from gpu_runtime.quant import linear

    default_bits = linear.DECODE_ACTIVATION_BITS
    linear.DECODE_ACTIVATION_BITS = activation_bits or default_bits
    try:
        return _measure(quantization)
    finally:
        linear.DECODE_ACTIVATION_BITS = default_bits


def _measure(quantization: str) -> dict:
    import torch

    from gpu_runtime import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(quantization=quantization, max_num_seqs=NUM_STREAMS, max_model_len=2048)
    engine, params = llm.engine, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate([prompt(99)], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    per_token = []
    for rep in range(2):
        engine.add_request(f"one-{rep}", llm.tokenizer.encode(prompt(50 + rep)), params)
        engine.step()  # the prefill, and the first token
        started = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        per_token.append((time.perf_counter() - started) / steps * 1000)
    started = time.perf_counter()
    outputs = llm.generate([prompt(i) for i in range(NUM_STREAMS)], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "ms_per_token_batch1": round(min(per_token), 2),
        "streams_tokens_per_s": round(generated / elapsed, 1),
        "weights_bytes": engine.memory.weights_bytes,
    }


_LLAMA_CPP = """
import json, sys, time
from llama_cpp import Llama
path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_threads=1, n_threads_batch=1, n_ctx=2048, verbose=False)
def generate(text):
    tokens, count, first = llm.tokenize(text.encode()), 0, None
    for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
        count += 1
        first = first or time.perf_counter()
        if count == n:
            break
    return count, (time.perf_counter() - first) / (count - 1) * 1000
generate(prompts[-1])
per_token = min(generate(prompts[-2 - rep])[1] for rep in range(2))
started = time.perf_counter()
generated = sum(generate(p)[0] for p in prompts[:-3])  # a server's streams, one after another
print(json.dumps({"ms_per_token_batch1": round(per_token, 2),
                  "streams_tokens_per_s": round(generated / (time.perf_counter() - started), 1)}))
"""


def bench_llama_cpp(python: str, gguf: Path) -> dict:
    prompts = [prompt(i) for i in range(NUM_STREAMS)] + [prompt(51), prompt(50), prompt(99)]
    result = subprocess.run(
        [python, "-c", _LLAMA_CPP, str(gguf), json.dumps(prompts), str(NUM_TOKENS)],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    from gguf import GGUFReader

    figures["weights_bytes"] = sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors)
    return figures


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["servers"])
    metrics = [("ms_per_token_batch1", "batch-1 ms / output token (lower is better)"),
               ("streams_tokens_per_s", f"{NUM_STREAMS} streams: output tokens/s"),
               ("weights_bytes", "resident weight MiB")]  # fmt: skip
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, (key, title) in zip(axes, metrics, strict=True):
        values = [results["servers"][n][key] / (1 << 20 if key == "weights_bytes" else 1) for n in names]
        labels = [name.replace(" ", "\n", 1) for name in names]  # "tokend" above the rest: four bars' labels fit
        bars = axis.bar(labels, values, color=["#2b7bba", "#7fb3d5", "#999999", "#d95f02"][: len(names)])
        axis.bar_label(bars, fmt="%.1f")
        axis.set_title(title, fontsize=10)
        axis.tick_params(axis="x", labelsize=8)
    figure.suptitle(f"{results['model']}, {results['threads']} thread, {results['cpu']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python (e.g. /tmp/bench-venv/bin/python)")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args()
    from gpu_runtime.default_model import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    servers = {
        "tokend quantized": bench_tokend("auto"),
        "tokend quantized, float32 x": bench_tokend("auto", activation_bits=32),  # the decode path before int16
        "tokend float32": bench_tokend("none"),
    }
    if args.llama_python:
        servers["llama.cpp"] = bench_llama_cpp(args.llama_python, gguf)
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "")
    results = {"model": gguf.name, "threads": 1, "cpu": cpu, "load_average": os.getloadavg()[0], "servers": servers,
               "prompt_words": PROMPT_WORDS, "tokens": NUM_TOKENS, "streams": NUM_STREAMS}  # fmt: skip
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
