"""`tokend bench`'s flags, named as vLLM's `bench serve` names them."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from daemon.address_flag import add_address_flag
from daemon.bench.backends import ENDPOINTS

DATASETS = ("random", "long-tail", "prefix-repetition", "mixed-priority")


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="the gateway's root, e.g. http://127.0.0.1:8000 (OpenAI API)")
    add_address_flag(target)
    parser.add_argument(
        "--endpoint", choices=ENDPOINTS, default="completions",
        help="with --base-url: /v1/completions (the prompt as token ids) or /v1/chat/completions (the prompt as "
        "text in one user message)",
    )  # fmt: skip
    parser.add_argument("--model", default="", help="served model name (default: the daemon's default)")
    parser.add_argument(
        "--tokenizer", default=None,
        help="the served model's tokenizer: a directory holding tokenizer.json (`tokend tokenizer-path [--model "
        "NAME]` prints it; guidellm's --processor and vLLM's --tokenizer take the same directory). Prompt ids are "
        "drawn below its vocabulary and chat prompts are their decoded text; without it, ids below 256 and chat "
        "prompts of common words",
    )  # fmt: skip
    parser.add_argument("--api-key", default=None, help="a tenant's API key, sent as a Bearer token")
    parser.add_argument("--dataset-name", choices=DATASETS, default="random", help="the workload")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    parser.add_argument("--random-input-len", type=int, default=256, help="mean prompt tokens (random datasets)")
    parser.add_argument("--random-output-len", type=int, default=128, help="mean output tokens (random datasets)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary by this fraction")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="closed loop: at most this many at once")
    parser.add_argument("--goodput", nargs="*", default=[], help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:10000")
    parser.add_argument(
        "--percentile-metrics", default="ttft,tpot,itl,e2el", help="comma-separated metrics to report stats of"
    )
    parser.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "50,90,99"')
    parser.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrival times")
    parser.add_argument("--label", default=None, help="the result's label and file name prefix (default: backend)")
    parser.add_argument("--save-result", action="store_true", help="save the result as JSON, keys as vLLM's")
    parser.add_argument(
        "--save-detailed", action="store_true",
        help="with --save-result: keep the per-request arrays (input_lens, output_lens, ttfts, itls, "
        "generated_texts, errors, ...)",
    )  # fmt: skip
    parser.add_argument("--result-dir", type=Path, default=None, help="where --save-result writes (default: here)")
    parser.add_argument(
        "--result-filename", default=None,
        help="the file --save-result writes (default: {label}-{request_rate}qps[-concurrency{N}]-{model}-{date}.json)",
    )  # fmt: skip
    parser.add_argument("--json-out", type=Path, default=None, help="also write the detailed result to this file")
    parser.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar")
