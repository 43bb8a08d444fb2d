"""`tokend generate`: streams completions from a running daemon over gRPC (or, with --offline, in-process)."""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from daemon.api_key import API_KEY_ENV, api_key_of
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

# While a daemon starts, ListModels is asked this often, each answer awaited at most this long.
_POLL_INTERVAL_S, _POLL_TIMEOUT_S = 0.5, 2.0


def run_generate(args: argparse.Namespace) -> int:
    """Streams each prompt's text to stdout as it decodes, then its usage and request id to stderr; first waits
    (up to --wait) for the model to serve, so that a command typed while the daemon starts answers once it can."""
    metadata = auth_metadata(api_key_of(args))
    with grpc.insecure_channel(args.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        if not wait_until_served(stub, args.model or "", args.wait, metadata, args.address):
            return 1
        for prompt in args.prompts:
            request = pb.GenerateRequest(
                model=args.model or "",
                sampling=pb.SamplingParams(
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                    top_p=args.top_p,
                    top_k=args.top_k,
                    seed=args.seed,
                    stop=args.stop,
                ),
            )
            if args.chat:  # the frontend renders it with the model's chat template
                request.chat.messages.add(role="user", content=prompt)
            else:
                request.prompt = prompt
            started = time.perf_counter()
            last = None
            call = stub.Generate(request, timeout=args.timeout, metadata=metadata)
            try:
                for chunk in call:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    last = chunk
            except grpc.RpcError as error:
                print(f"\ntokend: {error.code().name}: {error.details()}", file=sys.stderr)
                return 1
            seconds = time.perf_counter() - started
            usage = last.usage
            request_id = dict(call.initial_metadata() or ()).get("x-request-id", "")
            print(
                f"\n[{last.model}: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
                f"{usage.completion_tokens} completion tokens, finish_reason={last.finish_reason}, {seconds:.2f} s, "
                f"request_id={request_id}]",
                file=sys.stderr,
            )
    return 0


def wait_until_served(stub, model: str, wait_s: float, metadata, address: str) -> bool:
    """Polls ListModels until `model` (or the default model, with none named) is ready; False, having said why,
    if it is not within `wait_s`. Anything but a daemon still starting (an unknown model, a refused key) ends the
    wait at once: the request then reports it."""
    if wait_s <= 0:
        return True
    started = time.monotonic()
    terminal = sys.stderr.isatty()  # a progress line for a person at a terminal; scripts get only the outcome
    shown = False
    what = f"model {model!r}" if model else "the default model"
    status = f"no daemon listening at {address}"
    while True:
        try:
            models = stub.ListModels(pb.ListModelsRequest(), timeout=_POLL_TIMEOUT_S, metadata=metadata).models
        except grpc.RpcError as error:
            if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                break
        else:
            named = [m for m in models if not model or model == m.name or model in m.aliases][:1]
            if not named or named[0].ready:
                break
            status = f"{what} is loading"
        elapsed = time.monotonic() - started
        if elapsed >= wait_s:
            if shown:
                sys.stderr.write("\n")
            print(f"tokend: {status} after {wait_s:g} s (--wait)", file=sys.stderr)
            return False
        if terminal:
            shown = True
            sys.stderr.write(f"\rtokend: waiting for {what} to serve: {status} ({elapsed:.0f} s of {wait_s:g})")
            sys.stderr.flush()
        time.sleep(min(_POLL_INTERVAL_S, wait_s - elapsed))
    if shown:
        sys.stderr.write("\n")
    return True


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    """What the frontend authenticates tenants by; no key: none sent (a daemon without tenants needs none)."""
    if not api_key:
        return ()
    # gRPC metadata is printable ASCII: anything else would fail inside the channel, far from the cause.
    if not (api_key.isascii() and api_key.isprintable()):
        raise ValueError(f"api_key: must be printable ASCII (--api-key, --api-key-file or ${API_KEY_ENV})")
    return (("authorization", f"Bearer {api_key}"),)


def run_offline_generate(args: argparse.Namespace) -> int:
    """Generates all prompts in one batch in this process, through the offline LLM API."""
    if args.chat:
        raise ValueError("chat: --chat needs a daemon (its frontend renders the chat template); not with --offline")
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
    # A progress bar on a terminal only: piped or in CI, stderr stays quiet.
    outputs = llm.generate(args.prompts, params, use_tqdm=sys.stderr.isatty())
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
