"""What the daemon adds on top of the engine: output tokens/s at 32 concurrent gRPC streams versus the same
workload on the in-process engine, the same streams through the HTTP/SSE gateway versus direct gRPC, the
added time to first token at low load, and how long a client's cancel takes to reach the scheduler. Prints JSON.

    .venv/bin/python scripts/bench_overhead.py [--streams 32] [--output-len 128] [--out result.json]

On a machine with two or more cores, the engine gets core 1 with one torch thread in both setups (the
in-process engine, and the daemon's scheduler process); the frontend, the gateway and this client share core 0.
So the engine's compute is the same in every setup, and the ratios show what the processes, gRPC, ZeroMQ and
HTTP/SSE cost it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import grpc
import httpx
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from bench_engine import emit_json, write_bench_model  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from tokend.v1 import tokend_pb2 as pb  # noqa: E402
from tokend.v1 import tokend_pb2_grpc as pb_grpc  # noqa: E402

VOCAB = 258  # the byte-level tokenizer's: every generated token detokenizes to real text
ENGINE_CORE, OVERHEAD_CORE = 1, 0


def log(message: str) -> None:
    print(f"[bench_overhead] {message}", file=sys.stderr, flush=True)


def workload(num_streams: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(prompt_len)] for _ in range(num_streams)]


# -- in-process -------------------------------------------------------------------------------------------------


def in_process_throughput(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{index}", prompt, params)
    num_tokens = 0
    while engine.has_unfinished_requests():
        num_tokens += sum(len(output.new_token_ids) for output in engine.step())
    seconds = time.perf_counter() - started
    return {"output_tokens": num_tokens, "seconds": seconds, "tokens_per_s": num_tokens / seconds}


def in_process_ttft(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[float]:
    samples = []
    for index, prompt in enumerate(prompts):
        started = time.perf_counter()
        engine.add_request(f"{tag}-{index}", prompt, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        samples.append(time.perf_counter() - started)
    return samples


# -- through gRPC -----------------------------------------------------------------------------------------------


async def grpc_throughput(address: str, prompts: list[list[int]], output_len: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def stream(prompt: list[int]) -> int:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True),
            )
            num_tokens = 0
            async for chunk in stub.Generate(request):
                num_tokens += len(chunk.token_ids)
            return num_tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(stream(p) for p in prompts))
        seconds = time.perf_counter() - started
    return {"output_tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds}


async def gateway_throughput(base_url: str, prompts: list[list[int]], output_len: int) -> dict:
    """The same streams as OpenAI completions over HTTP/SSE; every event is parsed, as a real client does."""
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:

        async def stream(prompt: list[int]) -> int:
            body = {
                "prompt": prompt,
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            completion_tokens = 0
            async with client.stream("POST", "/v1/completions", json=body) as reply:
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            completion_tokens = chunk["usage"]["completion_tokens"]
            return completion_tokens

        started = time.perf_counter()
        counts = await asyncio.gather(*(stream(p) for p in prompts))
        seconds = time.perf_counter() - started
    return {"output_tokens": sum(counts), "seconds": seconds, "tokens_per_s": sum(counts) / seconds}


async def grpc_ttft(address: str, prompts: list[list[int]]) -> list[float]:
    samples = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for prompt in prompts:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(max_tokens=1, temperature=0)
            )
            started = time.perf_counter()
            async for _ in stub.Generate(request):
                samples.append(time.perf_counter() - started)
                break
    return samples


async def abort_latency(daemon: LocalDaemon, prompt: list[int], samples: int) -> list[float]:
    """Seconds from a client's cancel to its scheduler dropping the request (the scheduler's log says when)."""
    latencies = []
    async with grpc.aio.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for index in range(samples):
            request_id = f"abort-latency-{index}"
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                request_id=request_id,
                sampling=pb.SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True),
            )
            call = stub.Generate(request)
            for _ in range(3):
                await call.read()
            cancelled_at = time.time()
            call.cancel()
            aborted_at = await asyncio.to_thread(_logged_time, daemon, "request_aborted", request_id)
            latencies.append(aborted_at - cancelled_at)
    return latencies


def _logged_time(daemon: LocalDaemon, event: str, request_id: str, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in daemon.log_entries(event, request_id=request_id):
            return datetime.fromisoformat(entry["timestamp"]).timestamp()
        time.sleep(0.01)
    raise TimeoutError(f"no {event} logged for {request_id}")


# -- placement --------------------------------------------------------------------------------------------------


def pin(pid: int, core: int) -> None:
    """Pins every thread of the process (threads started earlier keep their own affinity otherwise)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--ttft-samples", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3, help="alternating in-process / gRPC runs")
    parser.add_argument("--no-pin", action="store_true", help="let the OS place everything")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    pinned = not args.no_pin and os.cpu_count() >= 2
    torch.set_num_threads(1)
    prompts = workload(args.streams, args.prompt_len)
    ttft_prompts = workload(args.ttft_samples, 16, seed=1)
    with tempfile.TemporaryDirectory(prefix="tokend-bench-") as scratch:
        model_dir = Path(scratch) / "model"
        num_params = write_bench_model(model_dir, vocab_size=VOCAB)
        log(f"bench model: {num_params / 1e6:.1f} M parameters")
        engine_options = dict(max_num_seqs=args.streams, kv_cache_bytes=256 << 20)
        engine = LLMEngine(EngineConfig(model=str(model_dir), **engine_options))
        flags = ["--model", str(model_dir), "--max-num-seqs", str(args.streams), "--kv-cache-bytes", str(256 << 20)]
        with LocalDaemon(*flags, env={"OMP_NUM_THREADS": "1", "TOKEND_DEBUG": "0"}) as daemon:
            if pinned:
                for scheduler in daemon.child_pids("tokend: scheduler"):
                    pin(scheduler, ENGINE_CORE)
                for overhead in daemon.child_pids("tokend: frontend") + daemon.child_pids("tokend: gateway"):
                    pin(overhead, OVERHEAD_CORE)
            in_process_runs, grpc_runs, gateway_runs = [], [], []
            # Warm both paths once, then alternate, so that machine noise hits both alike.
            in_process_throughput(engine, prompts[:4], 8, "warm")
            asyncio.run(grpc_throughput(daemon.address, prompts[:4], 8))
            asyncio.run(gateway_throughput(daemon.http_url, prompts[:4], 8))
            for round_index in range(args.rounds):
                if pinned:
                    pin(os.getpid(), ENGINE_CORE)
                in_process_runs.append(in_process_throughput(engine, prompts, args.output_len, f"r{round_index}"))
                if pinned:
                    pin(os.getpid(), OVERHEAD_CORE)
                grpc_runs.append(asyncio.run(grpc_throughput(daemon.address, prompts, args.output_len)))
                gateway_runs.append(asyncio.run(gateway_throughput(daemon.http_url, prompts, args.output_len)))
                log(
                    f"round {round_index}: in-process {in_process_runs[-1]['tokens_per_s']:.0f} tok/s, "
                    f"gRPC {grpc_runs[-1]['tokens_per_s']:.0f} tok/s, "
                    f"gateway {gateway_runs[-1]['tokens_per_s']:.0f} tok/s"
                )
            if pinned:
                pin(os.getpid(), ENGINE_CORE)
            ttft_in_process = in_process_ttft(engine, ttft_prompts, "ttft")
            if pinned:
                pin(os.getpid(), OVERHEAD_CORE)
            ttft_grpc = asyncio.run(grpc_ttft(daemon.address, ttft_prompts))
            aborts = asyncio.run(abort_latency(daemon, prompts[0], samples=10))

    in_process_best = max(run["tokens_per_s"] for run in in_process_runs)
    grpc_best = max(run["tokens_per_s"] for run in grpc_runs)
    gateway_best = max(run["tokens_per_s"] for run in gateway_runs)
    p50_in_process, p50_grpc = statistics.median(ttft_in_process), statistics.median(ttft_grpc)
    emit_json(
        {
            "benchmark": "daemon_overhead",
            "model_parameters": num_params,
            "streams": args.streams,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "placement": (
                f"engine on core {ENGINE_CORE} with 1 torch thread in every setup; frontend, gateway and client "
                f"on core "
                f"{OVERHEAD_CORE}"
                if pinned
                else "unpinned"
            ),
            "in_process_runs": in_process_runs,
            "grpc_runs": grpc_runs,
            "in_process_tokens_per_s": in_process_best,
            "grpc_tokens_per_s": grpc_best,
            "throughput_ratio": grpc_best / in_process_best,
            "throughput_ratio_target": 0.9,
            "gateway_runs": gateway_runs,
            "gateway_tokens_per_s": gateway_best,
            "gateway_vs_grpc_ratio": gateway_best / grpc_best,
            "gateway_vs_grpc_ratio_target": 0.85,
            "ttft_p50_ms": {"in_process": 1e3 * p50_in_process, "grpc": 1e3 * p50_grpc},
            "ttft_p90_ms": {
                "in_process": 1e3 * statistics.quantiles(ttft_in_process, n=10)[-1],
                "grpc": 1e3 * statistics.quantiles(ttft_grpc, n=10)[-1],
            },
            "added_ttft_p50_ms": 1e3 * (p50_grpc - p50_in_process),
            "added_ttft_p50_ms_target": 5.0,
            "cancel_to_scheduler_abort_ms": {
                "p50": 1e3 * statistics.median(aborts),
                "max": 1e3 * max(aborts),
                "target_max": 100.0,
            },
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
