"""`tokend bench`: the command line over datasets, backends and the runner (flags named as vLLM's)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc

from daemon.bench import datasets
from daemon.bench.backends import GrpcBackend, OpenAIBackend
from daemon.bench.runner import run_benchmark
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


def run_bench(args: argparse.Namespace) -> int:
    slos = _parse_goodput(args.goodput)
    result = asyncio.run(_run(args, slos))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0 if result["completed"] else 1


async def _run(args: argparse.Namespace, slos: dict[str, float]) -> dict:
    vocab = await _vocab_size(args)
    requests = _dataset(args, vocab)
    backend = (
        GrpcBackend(args.grpc, args.model, args.api_key)
        if args.grpc
        else OpenAIBackend(args.base_url, args.model, args.api_key)
    )
    try:
        result = await run_benchmark(
            backend, requests, args.request_rate, args.burstiness, args.max_concurrency, args.seed, slos,
            progress=not args.no_progress,
        )  # fmt: skip
    finally:
        await backend.close()
    result.update(dataset=args.dataset_name, backend="grpc" if args.grpc else "openai-completions", seed=args.seed)
    return result


async def _vocab_size(args: argparse.Namespace) -> int:
    """Token ids are drawn below the served model's vocabulary, which ListModels tells."""
    address = args.grpc
    if address is None:
        return 256  # the gateway's /v1/models does not say; byte ids are valid for every tokenizer we serve
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30)
    models = {m.name: m for m in reply.models}
    model = models.get(args.model) if args.model else (reply.models[0] if reply.models else None)
    return model.vocab_size if model and model.vocab_size else 256


def _dataset(args: argparse.Namespace, vocab: int) -> list[datasets.BenchRequest]:
    n, seed = args.num_prompts, args.seed
    if args.dataset_name == "long-tail":
        return datasets.long_tail_dataset(n, vocab, seed)
    if args.dataset_name == "prefix-repetition":
        return datasets.prefix_repetition_dataset(n, vocab, seed)
    if args.dataset_name == "mixed-priority":
        return datasets.mixed_priority_dataset(n, vocab, args.random_input_len, args.random_output_len, seed)
    return datasets.random_dataset(
        n, vocab, args.random_input_len, args.random_output_len, args.random_range_ratio, seed
    )


def _parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            print(f"tokend bench: goodput: expected ttft|tpot|e2el:<ms>, got {item!r}", file=sys.stderr)
            raise SystemExit(2)
        slos[name] = float(value)
    return slos
