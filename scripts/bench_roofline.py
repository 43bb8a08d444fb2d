"""Roofline of a decode step: this machine's limits, the weights-only matmul chain, and the engine's step, side by side.

Prints one JSON object (and writes a plot with --plot). In one run it measures
- the machine: GEMM throughput (a large square matmul) and memory bandwidth (a large tensor copy);
- per batch size and context length: the engine's decode step (LLMEngine.step(), scheduler and sampler
  included), the weights-only chain (the same checkpoint's q/k/v, o, gate/up, down and LM-head matmuls in
  plain torch: no attention, no bookkeeping), the same chain through the engine's own linear layers (prepacked
  for oneDNN on a CPU, gpu_runtime/model/cpu_weights.py), and the bound: the larger of (weight + KV bytes) /
  bandwidth and FLOPs / GEMM throughput.

Usage:
  .venv/bin/python scripts/bench_roofline.py                       # the decode issue's ~32M Llama, float32
  .venv/bin/python scripts/bench_roofline.py --device cuda --dtype bfloat16 --shape 8b --batches 1,16,64 \
      --contexts 256 --profile-step
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from roofline.machine import machine_limits  # noqa: E402
from roofline.shapes import DUMMY_WEIGHT_SHAPES, SHAPES, write_random_checkpoint  # noqa: E402
from roofline.steps import decode_bound, engine_and_chain_ms, profile_one_step  # noqa: E402


def main() -> None:
    args = _parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    limits = machine_limits(device, dtype)
    _log(f"machine: {limits}")
    result = {"device": str(device), "dtype": args.dtype, "shape": args.shape, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": limits, "decode": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="tokend-roofline-") as tmp:
        # Shapes too big to write (8b) are drawn by the engine on its device instead (load_format "dummy").
        with_weights = args.shape not in DUMMY_WEIGHT_SHAPES
        model_dir = write_random_checkpoint(Path(tmp), SHAPES[args.shape], dtype, with_weights=with_weights)
        for backend in args.backends.split(","):
            for context in _ints(args.contexts):
                for batch in _ints(args.batches):
                    row = _measure(model_dir, backend, batch, context, args, device, limits)
                    _log(json.dumps(row))
                    result["decode"].append(row)
        if args.profile_step:
            result["profile"] = profile_one_step(model_dir, args.backends.split(",")[0], max(_ints(args.batches)),
                                                 _ints(args.contexts)[0], args)  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    if args.plot:
        from roofline.plot import plot_roofline

        plot_roofline(result, Path(args.plot))


def _measure(model_dir: Path, backend: str, batch: int, context: int, args, device, limits) -> dict:
    engine_ms, chain_ms, own_chain_ms, llm = engine_and_chain_ms(model_dir, backend, batch, context, args)
    engine = llm.engine
    bound = decode_bound(engine.model_config, engine.dtype, batch, context, limits)
    return {
        "backend": engine.attention_backend,
        "batch": batch,
        "context": context,
        "engine_ms": round(engine_ms, 3),
        "chain_ms": round(chain_ms, 3),
        "engine_linears_chain_ms": round(own_chain_ms, 3),
        "bound_ms": round(bound["bound_ms"], 3),
        "engine_over_chain": round(engine_ms / chain_ms, 3),
        # The step's own overhead (attention, norms, bookkeeping), apart from how fast its matmuls run.
        "engine_over_engine_linears_chain": round(engine_ms / own_chain_ms, 3),
        "engine_over_bound": round(engine_ms / bound["bound_ms"], 3),
        "chain_over_bound": round(chain_ms / bound["bound_ms"], 3),
        **{key: value for key, value in bound.items() if key != "bound_ms"},
    }


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="256,1024")
    parser.add_argument("--backends", default="auto", help="attention backends to compare, comma-separated")
    parser.add_argument("--steps", type=int, default=16, help="decode steps (and chain runs, in turns) per point")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--profile-step", action="store_true", help="kernel launches and syncs of one step")
    parser.add_argument("--json-out", default="")
    parser.add_argument("--plot", default="")
    return parser.parse_args()


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _log(message: str) -> None:
    print(f"[bench_roofline] {message}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    _log(f"done in {time.perf_counter() - started:.0f} s")
