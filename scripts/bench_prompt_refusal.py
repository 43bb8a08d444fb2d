"""What refusing a prompt far past the context costs the frontend: seconds of tokenizing and the memory it takes.

Prints one JSON object: for each context length, the time `Tokenizer.encode(text, max_tokens=context)` takes to
refuse a text of --megabytes (the gRPC message limit is 4 MiB), the tokens it counted before refusing, and how much
the process's peak resident memory grew (each context measured in a fresh process, so that one's peak does not hide
another's). The embedded default model's byte-level tokenizer: one token a byte, the most tokens a text can have.
Usage:  .venv/bin/python scripts/bench_prompt_refusal.py [--contexts 131072 1048576] [--megabytes 3.9]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.default_model import ensure_tiny_random_model  # noqa: E402
from gpu_runtime.tokenizer import Tokenizer, TooManyTokens  # noqa: E402


def measure_one(context: int, megabytes: float) -> dict:
    text = ("Tell me everything about the history of the world. " * 200_000)[: int(megabytes * 1_000_000)]
    tokenizer = Tokenizer(ensure_tiny_random_model())
    peak_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    try:
        tokenizer.encode(text, True, max_tokens=context)
        counted, refused = None, False
    except TooManyTokens as too_many:
        counted, refused = too_many.num_tokens, True
    seconds = time.perf_counter() - started
    peak_growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before_kib) / 1024
    return {
        "context": context,
        "text_chars": len(text),
        "refused": refused,
        "tokens_counted": counted,
        "seconds": round(seconds, 3),
        "peak_rss_growth_mib": round(peak_growth_mib, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[131072, 1048576, 3145728])
    parser.add_argument("--megabytes", type=float, default=3.9)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure this context only
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one, args.megabytes)))
        return
    rows = []
    for context in args.contexts:
        child = [sys.executable, __file__, "--one", str(context), "--megabytes", str(args.megabytes)]
        rows.append(json.loads(subprocess.run(child, check=True, capture_output=True, text=True).stdout))
    print(json.dumps({"benchmark": "prompt_refusal", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
