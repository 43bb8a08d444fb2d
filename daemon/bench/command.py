"""`tokend bench`: the command line over datasets, backends and the runner (flags, printed table and result file
as vLLM's `bench serve` has them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import datetime
from pathlib import Path

import grpc

from daemon.bench import datasets
from daemon.bench.backends import GrpcBackend, OpenAIBackend
from daemon.bench.metrics import result_table
from daemon.bench.runner import run_benchmark
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

# What vLLM keeps out of the result file without --save-detailed: one entry per request.
PER_REQUEST_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
BYTE_VOCAB = 256  # without a tokenizer: byte ids are valid for every tokenizer tokend serves


def run_bench(args: argparse.Namespace) -> int:
    slos = _parse_goodput(args.goodput)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    started = datetime.now()
    result = asyncio.run(_run(args, slos, percentiles))
    result = _header(args, started) | result
    print(result_table(result, percentiles))
    failures = [error for error in result["errors"] if error]
    for index, error in enumerate(failures[:10]):
        print(f"Error {index}: {error}", file=sys.stderr)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    if args.save_result:
        saved = result if args.save_detailed else {k: v for k, v in result.items() if k not in PER_REQUEST_KEYS}
        path = _result_path(args, result, started)
        path.write_text(json.dumps(saved) + "\n")
        print(f"result saved to {path}", file=sys.stderr)
    return 0 if result["completed"] else 1


def _backend_name(args: argparse.Namespace) -> str:
    """vLLM's --backend for the same requests: `openai` (completions), `openai-chat`; tokend's gRPC is `grpc`."""
    if args.address:
        return "grpc"
    return "openai-chat" if args.endpoint == "chat" else "openai"


def _header(args: argparse.Namespace, started: datetime) -> dict:
    backend = _backend_name(args)
    return {
        "date": started.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": args.label or backend,
        "model_id": args.model,
        "tokenizer_id": args.tokenizer,
        "dataset": args.dataset_name,
        "seed": args.seed,
    }


def _result_path(args: argparse.Namespace, result: dict, started: datetime) -> Path:
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    model = (args.model or "default").split("/")[-1]
    name = args.result_filename or (
        f"{result['label']}-{args.request_rate}qps{concurrency}-{model}-{result['date']}.json"
    )
    directory = args.result_dir or Path(".")
    directory.mkdir(parents=True, exist_ok=True)
    return directory / name


async def _run(args: argparse.Namespace, slos: dict[str, float], percentiles: tuple[float, ...]) -> dict:
    tokenizer = _load_tokenizer(args.tokenizer)
    vocab = tokenizer.get_vocab_size() if tokenizer is not None else await _vocab_size(args)
    requests = _dataset(args, vocab)
    if args.base_url and args.endpoint == "chat":
        requests = datasets.with_prompt_text(requests, tokenizer, args.seed)
    backend = (
        GrpcBackend(args.address, args.model, args.api_key)
        if args.address
        else OpenAIBackend(args.base_url, args.model, args.api_key, args.endpoint)
    )
    try:
        return await run_benchmark(
            backend, requests, args.request_rate, args.burstiness, args.max_concurrency, args.seed, slos,
            progress=not args.no_progress, percentiles=percentiles,
            percentile_metrics=tuple(args.percentile_metrics.split(",")),
        )  # fmt: skip
    finally:
        await backend.close()


def _load_tokenizer(path: str | None):
    if path is None:
        return None
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        print(f"tokend bench: --tokenizer: no tokenizer.json at {path} (`tokend tokenizer-path` prints one)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return Tokenizer.from_file(str(file))


async def _vocab_size(args: argparse.Namespace) -> int:
    """Over gRPC, token ids are drawn below the served model's vocabulary, which ListModels tells."""
    address = args.address
    if address is None:
        return BYTE_VOCAB  # the gateway's /v1/models does not say
    metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await pb_grpc.GenerationStub(channel).ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=30)
    models = {m.name: m for m in reply.models}
    model = models.get(args.model) if args.model else (reply.models[0] if reply.models else None)
    return model.vocab_size if model and model.vocab_size else BYTE_VOCAB


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
