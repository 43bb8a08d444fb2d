"""`tokend bench`'s flags, named as vLLM's `bench serve` names them."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

DATASETS = ("random", "long-tail", "prefix-repetition", "mixed-priority")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="the gateway's root, e.g. http://127.0.0.1:8000 (OpenAI completions)")
    target.add_argument("--grpc", help="the daemon's gRPC address, e.g. 127.0.0.1:50051")
    parser.add_argument("--model", default="", help="served model name (default: the daemon's default)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", choices=DATASETS, default="random")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most this many at once")
    parser.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
