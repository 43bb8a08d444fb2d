"""`tokend generate`: streams completions from a running daemon over gRPC (or, with --offline, in-process)."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


def run_generate(args: argparse.Namespace) -> int:
    """Streams each prompt's text to stdout as it decodes, then its usage to stderr."""
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in args.prompts:
            request = pb.GenerateRequest(
                model=args.model or "",
                prompt=prompt,
                sampling=pb.SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=args.top_k,
                    seed=args.seed,
                    stop=args.stop,
                ),
            )
            started = time.perf_counter()
            last = None
            try:
                for chunk in stub.Generate(request, timeout=args.timeout):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
            except grpc.RpcError as error:
                print(f"\ntokend: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            seconds = time.perf_counter() - started
            usage = last.usage
            print(
                f"\n[{last.model}: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
                f"{usage.completion_tokens} completion tokens, finish_reason={last.finish_reason}, {seconds:.2f} s]",
                file=sys.stderr,
            )
    return 0


def run_offline_generate(args: argparse.Namespace) -> int:
    """Generates all prompts in one batch in this process, through the offline LLM API."""
    from gpu_runtime import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    started = time.perf_counter()
    outputs = llm.generate(args.prompts, params)
    seconds = time.perf_counter() - started
    engine = llm.engine
    print(f"model {engine.model_name} on {engine.device} ({engine.dtype}), {engine.kv.num_pages} KV pages")
    for output in outputs:
        completion = output.outputs[0]
        print(f"\n--- prompt {output.request_id}: {output.prompt!r}")
        print(f"{completion.text!r}")
        print(f"({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.1f} tokens/s)")
    return 0
