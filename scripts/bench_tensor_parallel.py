"""What tensor parallelism costs a decode step: the engine's step at tensor_parallel_size 1 and N side by side, and
the time rank 0 spends inside the step's collectives (the all-reduces after attention and after the MLP, the
embedding's, and the logits' gather), timed around torch.distributed's calls.

On a CPU the N ranks are processes sharing this machine's cores (each gets cores / N threads), so no speed-up is
expected: the figure that carries over is the collectives' share of a step. On a GPU box run it with --device cuda
--world-size 2 (and the GPU check script runs it there).

    .venv/bin/python scripts/bench_tensor_parallel.py [--world-size 2] [--batches 1,8,32] [--context 256]

JSON on stdout: {"machine": ..., "rows": [{"batch", "context", "tp1_step_ms", "tpN_step_ms", "collective_ms",
"collective_share", "collectives_per_step", "collective_bytes_per_step"}, ...]}; medians over --steps steps.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from machine_facts import machine_facts  # noqa: E402
from roofline.shapes import SHAPES, write_random_checkpoint  # noqa: E402

from gpu_runtime import LLM, SamplingParams  # noqa: E402


class CollectiveClock:
    """Wraps torch.distributed's all_reduce and gather (the model's collectives) to add up their time and bytes."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.bytes = 0
        for name in ("all_reduce", "gather"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, collective):
        def timed(tensor, *args, **kwargs):
            started = time.perf_counter()
            result = collective(tensor, *args, **kwargs)
            if tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
            self.seconds += time.perf_counter() - started
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return result

        return timed

    def reset(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0


def decode_steps(llm: LLM, batch: int, context: int, steps: int, clock: CollectiveClock) -> dict:
    """Median step time (ms) while `batch` sequences decode at about `context` tokens, and the collectives' time,
    calls and bytes per step (medians)."""
    engine = llm.engine
    rng = random.Random(batch * 7919 + context)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    ids = [f"tp-{batch}-{context}-{i}" for i in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(256) for _ in range(context)], params)
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(delta.request_id for delta in engine.step())
    engine.step()  # warm
    step_ms, collective_ms, calls, sent = [], [], [], []
    for _ in range(steps):
        clock.reset()
        started = time.perf_counter()
        engine.step()
        step_ms.append((time.perf_counter() - started) * 1e3)
        collective_ms.append(clock.seconds * 1e3)
        calls.append(clock.calls)
        sent.append(clock.bytes)
    for request_id in ids:
        engine.abort_request(request_id)
    median = statistics.median
    return {"step_ms": median(step_ms), "collective_ms": median(collective_ms), "calls": median(calls),
            "bytes": median(sent)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    clock = CollectiveClock()
    began = time.monotonic()
    rows = {b: {"batch": b, "context": args.context} for b in batches}
    with tempfile.TemporaryDirectory(prefix="tokend-tp-bench-") as tmp:
        model_dir = write_random_checkpoint(Path(tmp), SHAPES[args.shape], getattr(torch, args.dtype))
        options = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(batches), enable_prefix_caching=False,
                       max_num_batched_tokens=max(4096, max(batches)))  # fmt: skip
        for size in (1, args.world_size):
            with LLM(str(model_dir), tensor_parallel_size=size, **options) as llm:
                for batch in batches:
                    measured = decode_steps(llm, batch, args.context, args.steps, clock)
                    print(f"[bench_tensor_parallel] tp={size} batch={batch}: {measured}", file=sys.stderr, flush=True)
                    rows[batch][f"tp{size}_step_ms"] = round(measured["step_ms"], 3)
                    if size > 1:
                        rows[batch]["collective_ms"] = round(measured["collective_ms"], 3)
                        rows[batch]["collective_share"] = round(measured["collective_ms"] / measured["step_ms"], 3)
                        rows[batch]["collectives_per_step"] = measured["calls"]
                        rows[batch]["collective_bytes_per_step"] = measured["bytes"]
    result = {"machine": machine_facts(), "device": args.device, "dtype": args.dtype, "shape": args.shape,
              "world_size": args.world_size, "rows": list(rows.values()),
              "seconds": round(time.monotonic() - began, 1)}  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
