"""`tokend generate`: a demo generation on the command line, through the offline LLM API."""

from __future__ import annotations

import argparse
import time

from gpu_runtime import LLM, SamplingParams


def run_generate(args: argparse.Namespace) -> int:
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
