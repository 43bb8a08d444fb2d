"""Prefix-aware routing against least-loaded routing, side by side in one run on a real daemon with two workers,
each pinned to its own core (`--device cpu@0,cpu@1`), serving the default model; prints one JSON object.

- multi-turn: conversations (each opening with one of a few shared system prompts and a document of its own) arrive
  as a Poisson process at about 70% of the measured capacity; each sends its next turn (its history, the last reply
  and a new user message) when the previous one finished. Reported per routing: TTFT p50/p99, output throughput,
  and the prefix-cache hit rate (cached over prompt tokens, from every response's usage). Each worker's KV pool
  holds 3/4 of the conversations' histories: they fit the two pools once each, not twice.
- skewed: one hot system prompt for every request, sent faster than one worker serves: the split of requests between
  the workers shows the load term keeping the hot prefix from piling on the worker that holds it.

Usage: .venv/bin/python scripts/bench_prefix_routing.py [--quick] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

import grpc  # noqa: E402
from bench_engine import emit_json  # noqa: E402
from harness.local_daemon import LocalDaemon  # noqa: E402
from machine_facts import machine_facts  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from gpu_runtime.default_model import DEFAULT_MODEL_NAME  # noqa: E402
from tokend.v1 import tokend_pb2 as pb  # noqa: E402
from tokend.v1 import tokend_pb2_grpc as pb_grpc  # noqa: E402

NO_SHEDDING = ["--interactive-ttft-target", "1e6", "--batch-ttft-target", "1e6", "--max-queued-requests", "100000"]
WORDS = [
    "model", "serving", "routes", "every", "request", "where", "its", "cached", "prefix", "pages", "already", "wait",
    "for", "it", "while", "the", "load", "term", "keeps", "one", "worker", "from", "taking", "all", "of", "them",
    "and", "the", "other", "from", "idling", "during", "bursts", "of", "traffic",
]  # fmt: skip


def log(message: str) -> None:
    print(f"[bench_prefix_routing] {message}", file=sys.stderr, flush=True)


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


class Results:
    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.prompt_tokens = self.cached_tokens = self.output_tokens = 0
        self.started = time.monotonic()
        self.ended = self.started

    def take(self, ttft: float, usage: pb.Usage) -> None:
        self.ttfts.append(ttft)
        self.prompt_tokens += usage.prompt_tokens
        self.cached_tokens += usage.cached_tokens
        self.output_tokens += usage.completion_tokens
        self.ended = time.monotonic()

    def summary(self) -> dict:
        ttfts = sorted(self.ttfts)
        return {"requests": len(ttfts), "ttft_p50_s": round(statistics.median(ttfts), 4),
                "ttft_p99_s": round(percentile(ttfts, 99), 4),
                "output_tokens_per_s": round(self.output_tokens / (self.ended - self.started), 2),
                "cache_hit_rate": round(self.cached_tokens / self.prompt_tokens, 3)}  # fmt: skip


async def chat_turn(stub, messages: list[pb.ChatMessage], max_tokens: int, results: Results) -> str:
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=messages),
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    sent, first, reply, usage = time.monotonic(), None, [], None  # fmt: skip
    async for chunk in stub.Generate(request, timeout=600):
        if first is None and chunk.token_ids:
            first = time.monotonic()
        reply.append(chunk.text)
        if chunk.HasField("usage") and chunk.finish_reason:
            usage = chunk.usage
    results.take(first - sent, usage)
    return "".join(reply)


async def conversation(stub, system: str, rng: random.Random, turns: int, args, results: Results) -> None:
    """A shared system prompt, then a first user message carrying a document of its own (an agent's context, a
    file under discussion), then short user messages: each turn resends the whole history."""
    messages = [pb.ChatMessage(role="system", content=system)]
    for turn in range(turns):
        document = text(rng, args.document_words) + "\n\n" if turn == 0 else ""
        messages.append(pb.ChatMessage(role="user", content=document + text(rng, args.user_words)))
        reply = await chat_turn(stub, messages, args.output_tokens, results)
        messages.append(pb.ChatMessage(role="assistant", content=reply))


async def multi_turn(address: str, args, rate: float, seed: int) -> dict:
    """args.conversations conversations arriving at `rate` a second (Poisson), each of args.turns turns."""
    rng = random.Random(seed)
    systems = [text(rng, args.system_words) for _ in range(args.system_prompts)]
    results = Results()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        for i in range(args.conversations):
            tasks.append(asyncio.create_task(conversation(stub, systems[i % len(systems)], random.Random(seed + i),
                                                          args.turns, args, results)))  # fmt: skip
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return results.summary()


async def capacity(address: str, args) -> float:
    """Conversations a second the two workers sustain, from a closed loop of as many at once as they batch."""
    rng = random.Random(99)
    systems = [text(rng, args.system_words) for _ in range(args.system_prompts)]
    results = Results()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        started = time.monotonic()
        count = 2 * args.max_num_seqs
        await asyncio.gather(*(conversation(stub, systems[i % len(systems)], random.Random(1000 + i), args.turns,
                                            args, results) for i in range(count)))  # fmt: skip
    return count / (time.monotonic() - started)


async def skewed(address: str, args, rate: float) -> Results:
    """Single-turn requests that all open with one hot system prompt, at `rate` a second."""
    rng = random.Random(7)
    hot = text(rng, args.system_words)
    results = Results()
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        tasks = []
        for _ in range(args.skewed_requests):
            messages = [pb.ChatMessage(role="system", content=hot),
                        pb.ChatMessage(role="user", content=text(rng, args.user_words))]  # fmt: skip
            tasks.append(asyncio.create_task(chat_turn(stub, messages, args.output_tokens, results)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return results


def serve(weight: float, args) -> LocalDaemon:
    flags = ["--model", DEFAULT_MODEL_NAME, "--device", "cpu@0,cpu@1", "--max-num-seqs", str(args.max_num_seqs),
             "--prefix-routing-weight", str(weight), "--kv-cache-bytes", str(args.kv_cache_bytes)]  # fmt: skip
    return LocalDaemon(*flags, *NO_SHEDDING, env={"TOKEND_DEBUG": "0"})


def kv_cache_bytes(args) -> int:
    """Each worker's KV pool: 3/4 of the trace's whole working set (every conversation's final history), so that the
    conversations fit the two pools once each but not twice: the regime where routing decides what stays cached
    (least-loaded routing keeps a conversation's history on both workers, evicting others')."""
    from gpu_runtime.default_model import resolve_model_dir
    from gpu_runtime.model.config import load_model_config

    config = load_model_config(resolve_model_dir(DEFAULT_MODEL_NAME))
    per_token = config.kv_elements_per_token * 4  # float32 on a CPU
    words = args.system_words + args.document_words + args.turns * args.user_words
    tokens_per_conversation = 1.5 * words + args.turns * (args.output_tokens + 20)  # ~1.5 tokens a word, templates
    return int(0.75 * args.conversations * tokens_per_conversation * per_token)


def split(daemon: LocalDaemon, since: int) -> dict[str, int]:
    admitted = daemon.log_entries("request_admitted")[since:]
    return dict(collections.Counter(entry["worker"] for entry in admitted))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer conversations")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    args.conversations, args.turns = (12, 4) if args.quick else (32, 6)
    args.system_prompts, args.system_words, args.document_words = 4, 150, 400
    args.user_words, args.output_tokens = 30, 24
    args.max_num_seqs, args.skewed_requests = 8, 24 if args.quick else 48
    args.kv_cache_bytes = kv_cache_bytes(args)
    runs = {}
    for name, weight in (("prefix_aware", 1.0), ("least_loaded", 0.0)):
        with serve(weight, args) as daemon:
            if "capacity" not in runs:
                runs["capacity"] = asyncio.run(capacity(daemon.address, args))
                log(f"capacity {runs['capacity']:.3f} conversations/s")
            rate = 0.7 * runs["capacity"]
            log(f"{name}: multi-turn at {rate:.3f} conversations/s")
            start = len(daemon.log_entries("request_admitted"))
            runs[name] = asyncio.run(multi_turn(daemon.address, args, rate, seed=1))
            runs[name]["split"] = split(daemon, start)
            log(f"{name}: {runs[name]}")
            start = len(daemon.log_entries("request_admitted"))
            hot = asyncio.run(skewed(daemon.address, args, rate * args.turns * 1.5))
            runs[f"{name}_skewed"] = {**hot.summary(), "split": split(daemon, start)}
            log(f"{name} skewed: {runs[f'{name}_skewed']}")
    aware, loaded = runs["prefix_aware"], runs["least_loaded"]
    emit_json({
        "benchmark": "prefix_routing",
        "machine": machine_facts(),
        "model": DEFAULT_MODEL_NAME,
        "workers": "2, pinned: cpu@0, cpu@1",
        "kv_cache_bytes_per_worker": args.kv_cache_bytes,
        "conversations": args.conversations, "turns": args.turns, "system_prompts": args.system_prompts,
        "capacity_conversations_per_s": round(runs["capacity"], 4),
        "arrival_rate_conversations_per_s": round(0.7 * runs["capacity"], 4),
        "prefix_aware": aware, "least_loaded": loaded,
        "skewed_prefix_aware": runs["prefix_aware_skewed"], "skewed_least_loaded": runs["least_loaded_skewed"],
        "ttft_p50_aware_over_least_loaded": round(aware["ttft_p50_s"] / loaded["ttft_p50_s"], 3),
        "ttft_p99_aware_over_least_loaded": round(aware["ttft_p99_s"] / loaded["ttft_p99_s"], 3),
        "throughput_aware_over_least_loaded": round(aware["output_tokens_per_s"] / loaded["output_tokens_per_s"], 3),
    }, args.json_out)  # fmt: skip


if __name__ == "__main__":
    main()
