"""Sampler benchmark: milliseconds to pick one token per row from [batch, vocab] logits, per sampling setting.

Prints one JSON object. Usage:  .venv/bin/python scripts/bench_sampler.py [--vocab 32000] [--batch-sizes 1 32]
"Peaked" logits (standard deviation 4) stand for a trained model (entropy ~3 nats, a nucleus of ~100 tokens);
"flat" ones (standard deviation 0.5) for a random-weight model, whose nucleus is most of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.ipc.sampling_params import SamplingParams  # noqa: E402
from gpu_runtime.sampler import Sampler  # noqa: E402
from gpu_runtime.sequence import Sequence  # noqa: E402

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "seeded, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
}


def milliseconds_per_call(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence], repeats: int) -> float:
    for _ in range(3):
        sampler(logits, seqs)
    started = time.perf_counter()
    for _ in range(repeats):
        sampler(logits, seqs)
    return round((time.perf_counter() - started) / repeats * 1000, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    sampler = Sampler()
    results = {}
    for spread_name, spread in (("peaked", 4.0), ("flat", 0.5)):
        for batch in args.batch_sizes:
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(0)) * spread
            for name, params in SETTINGS.items():
                seqs = [
                    Sequence(f"r{i}", [1], params, max_model_len=1 << 20, eos_token_ids=frozenset(),
                             generator=torch.Generator().manual_seed(i) if params.seed is not None else None)
                    for i in range(batch)
                ]  # fmt: skip
                ms = milliseconds_per_call(sampler, logits, seqs, args.repeats)
                results.setdefault(f"{spread_name} logits, batch {batch}", {})[name] = ms
    print(json.dumps({"vocab": args.vocab, "torch_threads": torch.get_num_threads(), "ms_per_call": results}, indent=2))


if __name__ == "__main__":
    main()
