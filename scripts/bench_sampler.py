"""Sampler benchmark: milliseconds to pick one token per row from [batch, vocab] logits, per sampling setting.

Prints one JSON object. Usage:  .venv/bin/python scripts/bench_sampler.py [--vocab 32000] [--batch-sizes 1 32]
  [--device cpu|cuda] [--prompt-len 512] [--output-len 256] [--threads N]
"Peaked" logits (standard deviation 4) stand for a trained model (entropy ~3 nats, a nucleus of ~100 tokens);
"flat" ones (standard deviation 0.5) for a random-weight model, whose nucleus is most of the vocabulary.
Every row has a prompt of --prompt-len and --output-len generated tokens, which the penalties count at each step
(the repetition penalty's prompt set is built on a row's first step and kept, as in serving: the first call of a
timing warms it). "penalties, 1 row of 8" gives one row in eight a repetition penalty, the others nothing: the
cost of a batch that mixes. `no-adjustment check` is what a batch without any control pays for the penalties'
existence (one look at each row's params), in microseconds.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.ipc.sampling_params import SamplingParams  # noqa: E402
from gpu_runtime.penalties import apply_logit_adjustments  # noqa: E402
from gpu_runtime.sampler import Sampler  # noqa: E402
from gpu_runtime.sequence import Sequence  # noqa: E402

_BIAS = {token_id: 2.0 for token_id in range(0, 3000, 10)}  # 300 tokens, the most a request may bias
SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature 1": SamplingParams(temperature=1.0),
    "top_p 0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "seeded, top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9, seed=1),
    "greedy, repetition 1.2": SamplingParams(temperature=0, repetition_penalty=1.2),
    "greedy, presence+frequency": SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy, logit_bias 300": SamplingParams(temperature=0, logit_bias=_BIAS),
    "greedy, all penalties": SamplingParams(
        temperature=0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5
    ),
    "top_p 0.95, all penalties + bias": SamplingParams(
        temperature=0.8,
        top_p=0.95,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias=_BIAS,
    ),
    "penalties, 1 row of 8": None,  # built per batch: see mixed_params
}


def mixed_params(batch: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, repetition_penalty=1.2) if i % 8 == 0 else SETTINGS["greedy"]
        for i in range(batch)
    ]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def milliseconds_per_call(call, device: torch.device, repeats: int, rounds: int = 5) -> float:
    """The best of `rounds` means over `repeats` calls each: a shared machine's other work only ever adds time."""
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / repeats)
    return round(best * 1000, 3)


def make_seqs(params: list[SamplingParams], args, vocab: int, device: torch.device) -> list[Sequence]:
    rng = random.Random(0)
    seqs = []
    for i, p in enumerate(params):
        generator = torch.Generator().manual_seed(i) if p.seed is not None else None  # on the CPU, as the engine's
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        seq = Sequence(f"r{i}", prompt, p, max_model_len=1 << 20, eos_token_ids=frozenset(), generator=generator)
        seq.output_token_ids = [rng.randrange(vocab) for _ in range(args.output_len)]
        seqs.append(seq)
    return seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5, help="calls per timing round (5 rounds)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0: torch's own choice")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sampler = Sampler()
    results: dict[str, dict[str, float]] = {}
    checks: dict[str, float] = {}
    for spread_name, spread in (("peaked", 4.0), ("flat", 0.5)):
        for batch in args.batch_sizes:
            logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(0)).to(device) * spread
            for name, params in SETTINGS.items():
                rows = [params] * batch if params is not None else mixed_params(batch)
                seqs = make_seqs(rows, args, args.vocab, device)
                # The sampler adjusts its logits in place (the engine's are fresh every step): a copy per call.
                ms = milliseconds_per_call(lambda: sampler(logits.clone(), seqs), device, args.repeats)  # noqa: B023
                results.setdefault(f"{spread_name} logits, batch {batch}", {})[name] = ms
            plain = make_seqs([SETTINGS["greedy"]] * batch, args, args.vocab, device)
            check_ms = milliseconds_per_call(lambda: apply_logit_adjustments(logits, plain, True), device, 100)  # noqa: B023
            checks[f"batch {batch}"] = round(check_ms * 1000, 2)
    report = {
        "vocab": args.vocab,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "ms_per_call": results,
        "no_adjustment_check_us": checks,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
