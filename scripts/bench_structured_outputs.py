"""What structured outputs cost, side by side in one run on one daemon (the default model unless --model), over gRPC:

- TPOT of N concurrent constrained streams (a JSON Schema) against N unconstrained ones (target: ratio <= 1.10);
- in a mixed batch (half constrained), the free rows' TPOT against an all-free batch (target: <= 5% slower);
- TTFT of a never-seen schema against a cached one, one request at a time (target: p50 added <= 10 ms);
- the mask's own cost per token per row, measured in process on the same outputs (llguidance's fill, and
  applying the bitmask to the logits).

Every stream generates exactly --output-len tokens (the schema asks for far more, so all end at max_tokens), so each
batch keeps its size to the end. Prints JSON (--out writes it too).

    .venv/bin/python scripts/bench_structured_outputs.py [--streams 16] [--output-len 128] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import llguidance
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_engine import emit_json  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from daemon.bench.stream_client import StreamRecord, stream_generate_blocking  # noqa: E402
from gpu_runtime.default_model import DEFAULT_MODEL_NAME, resolve_model_dir  # noqa: E402
from gpu_runtime.ipc.structured_output import StructuredOutput  # noqa: E402
from gpu_runtime.model.config import load_capped_model_config  # noqa: E402
from gpu_runtime.structured.compiler import GrammarCompiler  # noqa: E402
from gpu_runtime.structured.masks import PendingMasks, fill_bitmask  # noqa: E402
from tokend.v1 import tokend_pb2 as pb  # noqa: E402

# Rows of records far longer than any --output-len: every constrained stream runs to max_tokens.
LONG_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string",
                       "maxLength": 12}, "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"],
        "additionalProperties": False,
    },
    "minItems": 200,
}  # fmt: skip
PROMPT = "<|im_start|>user\nList many records as JSON.<|im_end|>\n<|im_start|>assistant\n"


def log(message: str) -> None:
    print(f"[bench_structured_outputs] {message}", file=sys.stderr, flush=True)


def _request(output_len: int, schema: dict | None) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=output_len, temperature=1.0, seed=7, ignore_eos=True)
    if schema is not None:
        sampling.structured_output.json_schema = json.dumps(schema)
    return pb.GenerateRequest(prompt=PROMPT, sampling=sampling)


def _batch(daemon: LocalDaemon, requests: list[pb.GenerateRequest]) -> list[StreamRecord]:
    with ThreadPoolExecutor(len(requests)) as pool:
        records = list(pool.map(lambda r: stream_generate_blocking(daemon.generation, r, timeout=600), requests))
    failed = [r.error for r in records if r.error]
    if failed:
        raise SystemExit(f"streams failed: {failed[:3]}")
    return records


def _tpot_ms(records: list[StreamRecord]) -> float:
    return statistics.median(r.per_token_s for r in records) * 1000


def tpot(daemon: LocalDaemon, streams: int, output_len: int, rounds: int) -> dict:
    """Median per-token time of each batch shape, the shapes interleaved round by round (drift hits all alike)."""
    shapes = {"free": [], "constrained": [], "mixed_free_rows": [], "mixed_constrained_rows": []}
    for round_ in range(rounds):
        log(f"TPOT round {round_ + 1}/{rounds}")
        shapes["free"].append(_tpot_ms(_batch(daemon, [_request(output_len, None)] * streams)))
        shapes["constrained"].append(_tpot_ms(_batch(daemon, [_request(output_len, LONG_SCHEMA)] * streams)))
        half = streams // 2
        mixed = _batch(daemon, [_request(output_len, None)] * half + [_request(output_len, LONG_SCHEMA)] * half)
        shapes["mixed_free_rows"].append(_tpot_ms(mixed[:half]))
        shapes["mixed_constrained_rows"].append(_tpot_ms(mixed[half:]))
    median = {name: statistics.median(values) for name, values in shapes.items()}
    return {
        "tpot_ms": {name: round(value, 3) for name, value in median.items()},
        "tpot_ms_per_round": shapes,
        "constrained_over_free": round(median["constrained"] / median["free"], 4),
        "mixed_free_rows_over_free": round(median["mixed_free_rows"] / median["free"], 4),
    }


def ttft(daemon: LocalDaemon, count: int) -> dict:
    """One request at a time, a never-seen schema (a fresh enum value) and the cached one, alternately."""
    seen = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    fresh_ms, cached_ms = [], []
    stream_generate_blocking(daemon.generation, _ttft_request(seen))  # cached from here on
    for index in range(count):
        new = {**seen, "properties": {"answer": {"enum": ["yes", "no", f"maybe-{index}-{time.time_ns()}"]}}}
        fresh_ms.append(stream_generate_blocking(daemon.generation, _ttft_request(new)).ttft * 1000)
        cached_ms.append(stream_generate_blocking(daemon.generation, _ttft_request(seen)).ttft * 1000)
    p50_fresh, p50_cached = percentile(fresh_ms, 50), percentile(cached_ms, 50)
    return {
        "ttft_ms_p50": {"never_seen_schema": round(p50_fresh, 3), "cached_schema": round(p50_cached, 3)},
        "ttft_added_ms_p50": round(p50_fresh - p50_cached, 3),
        "requests_each": count,
    }


def _ttft_request(schema: dict) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=1, temperature=0)
    sampling.structured_output.json_schema = json.dumps(schema)
    return pb.GenerateRequest(prompt=PROMPT, sampling=sampling)


def mask_cost(model_dir: Path, rows: int, steps: int) -> dict:
    """llguidance's fill of `rows` matchers and the bitmask applied to [rows, vocab] logits, per token per row,
    along outputs the grammar allows (each matcher advanced by the best token its mask leaves)."""
    config = load_capped_model_config(model_dir, None)
    compiler = GrammarCompiler.for_model(model_dir, config.vocab_size, list(config.eos_token_ids))
    matchers = [compiler.matcher(StructuredOutput.json_schema(LONG_SCHEMA)) for _ in range(rows)]
    executor = llguidance.LLExecutor()
    bitmask = torch.empty((rows, (config.vocab_size + 31) // 32), dtype=torch.int32)
    ready: Future = Future()
    ready.set_result(None)
    fill_s = apply_s = 0.0
    for _ in range(steps):
        logits = torch.randn(rows, config.vocab_size)
        started = time.perf_counter()
        fill_bitmask(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        fill_s += time.perf_counter() - started
        started = time.perf_counter()
        PendingMasks(list(range(rows)), bitmask, ready).apply(logits)
        apply_s += time.perf_counter() - started
        for row, matcher in enumerate(matchers):
            matcher.consume_token(int(logits[row].argmax()))
    per = rows * steps
    return {"rows": rows, "steps": steps, "fill_us_per_token_row": round(fill_s / per * 1e6, 2),
            "apply_us_per_token_row": round(apply_s / per * 1e6, 2)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-requests", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model_dir = resolve_model_dir(args.model)
    result = {"model": args.model, "streams": args.streams, "output_len": args.output_len}
    with LocalDaemon("--model", args.model, "--device", "cpu", "--max-num-seqs", str(args.streams)) as daemon:
        _batch(daemon, [_request(8, LONG_SCHEMA)] * 2)  # warm: the schema compiled in the frontend and the worker
        result |= tpot(daemon, args.streams, args.output_len, args.rounds)
        result |= ttft(daemon, args.ttft_requests)
    result["mask_cost"] = mask_cost(model_dir, args.streams, 64)
    result["targets"] = {"constrained_over_free": 1.10, "mixed_free_rows_over_free": 1.05, "ttft_added_ms_p50": 10}
    emit_json(result, args.out)


if __name__ == "__main__":
    main()
