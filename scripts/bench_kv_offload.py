"""The host KV tier (--kv-offload-bytes) against none, side by side in one run; prints one JSON object.

- multi-turn: conversations whose contexts together are about 3x the device KV pool, visited round-robin, so that a
  conversation's pages have left the device pool by the time its next turn comes. Without the tier its whole history
  is prefilled again; with it the history's pages are loaded back from host memory. Reported: TTFT p50/p99 of the
  revisits (every turn after a conversation's first), and the ratio with the tier over without.
- no reuse: distinct prompts only (every page evicted is copied to host and never read again): throughput with the
  tier over without, the tier's whole cost.

Requests run closed-loop (`--concurrency` clients, each sending its next request when the last finished) through the
engine in this process, so a TTFT is the queue and prefill a revisit costs, not a network's. Usage:
    .venv/bin/python scripts/bench_kv_offload.py [--quick] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import MODEL_SHAPE, emit_json, write_bench_model  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from gpu_runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from gpu_runtime.kv_cache.kv_pool import page_bytes  # noqa: E402
from gpu_runtime.model.config import load_model_config  # noqa: E402

PAGE_SIZE = 16
VOCAB = MODEL_SHAPE["vocab_size"]


def log(message: str) -> None:
    print(f"[bench_kv_offload] {message}", file=sys.stderr, flush=True)


Turn = tuple[int, list[int]]  # (conversation, the tokens it adds to the conversation's transcript)


def run_closed_loop(engine: LLMEngine, clients: list[list[Turn]], output_tokens: int) -> tuple[list[dict], float]:
    """Each client sends its turns one after another, the next when the last finished; a turn's prompt is its
    conversation's transcript so far plus its new tokens, and its output joins the transcript. Returns per-request
    records and the seconds it all took."""
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    transcripts: dict[int, list[int]] = {}
    next_turn = [0] * len(clients)
    records, live = [], {}
    start = time.monotonic()

    def send(client: int) -> None:
        conv, new_tokens = clients[client][next_turn[client]]
        prompt = transcripts.get(conv, []) + new_tokens
        request_id = f"c{client}-t{next_turn[client]}"
        engine.add_request(request_id, prompt, params)
        live[request_id] = {"client": client, "conv": conv, "revisit": conv in transcripts, "prompt": prompt,
                            "sent": time.monotonic(), "first": None, "output": [], "cached": 0}  # fmt: skip
        next_turn[client] += 1

    for client in range(len(clients)):
        send(client)
    while live:
        for delta in engine.step():
            record = live[delta.request_id]
            if record["first"] is None and delta.new_token_ids:
                record["first"] = time.monotonic()
            record["output"] += delta.new_token_ids
            record["cached"] = delta.num_cached_tokens
            if delta.finish_reason is not None:
                del live[delta.request_id]
                records.append(record)
                transcripts[record["conv"]] = record["prompt"] + record["output"]
                if next_turn[record["client"]] < len(clients[record["client"]]):
                    send(record["client"])
    return records, time.monotonic() - start


def conversations(args, seed: int) -> list[list[Turn]]:
    """`args.conversations` conversations of `args.turns` turns, dealt round-robin to the clients: each opens with a
    long prompt of its own (its system prompt and documents), then a short user message per turn; each client goes
    through its conversations round-robin, so each comes back after all its others."""
    rng = random.Random(seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(count)]

    clients = []
    for client in range(args.concurrency):
        owned = range(client, args.conversations, args.concurrency)
        clients.append([(conv, (tokens(args.system_tokens) if turn == 0 else []) + tokens(args.user_tokens))
                        for turn in range(args.turns) for conv in owned])  # fmt: skip
    return clients


def make_engine(model_dir: Path, pool_bytes: int, offload_bytes: int, args) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), device=args.device, page_size=PAGE_SIZE, kv_cache_bytes=pool_bytes,
                          kv_offload_bytes=offload_bytes, max_num_seqs=args.concurrency)  # fmt: skip
    return LLMEngine(config)


def multi_turn(model_dir: Path, pool_bytes: int, offload_bytes: int, args) -> dict:
    engine = make_engine(model_dir, pool_bytes, offload_bytes, args)
    records, seconds = run_closed_loop(engine, conversations(args, seed=1), args.output_tokens)
    revisits = [r for r in records if r["revisit"]]
    ttfts = sorted(r["first"] - r["sent"] for r in revisits)
    host = engine.kv.host
    result = {
        "requests": len(records),
        "revisits": len(revisits),
        "revisit_ttft_p50_s": round(statistics.median(ttfts), 4),
        "revisit_ttft_p99_s": round(percentile(ttfts, 99), 4),
        "revisit_cached_token_share": round(
            sum(r["cached"] for r in revisits) / sum(len(r["prompt"]) for r in revisits), 3
        ),  # fmt: skip
        "seconds": round(seconds, 2),
        "host_pages_loaded": host.num_loaded if host else 0,
        "host_pages_offloaded": host.num_offloaded if host else 0,
    }
    engine.close()
    return result


def no_reuse(model_dir: Path, pool_bytes: int, offload_bytes: int, args) -> dict:
    engine = make_engine(model_dir, pool_bytes, offload_bytes, args)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.system_tokens)] for _ in range(args.distinct_prompts)]
    clients = [[(i, prompts[i]) for i in range(c, len(prompts), args.concurrency)] for c in range(args.concurrency)]
    records, seconds = run_closed_loop(engine, clients, args.output_tokens)
    tokens = sum(len(r["prompt"]) + len(r["output"]) for r in records)
    host = engine.kv.host
    result = {"requests": len(records), "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1),
              "host_pages_offloaded": host.num_offloaded if host else 0}  # fmt: skip
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer conversations and turns")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool-pages", type=int, default=256, help="the device KV pool, in pages of 16 tokens")
    parser.add_argument("--device", default="auto", help="auto (cuda when present: a pinned host tier), cpu, cuda")
    args = parser.parse_args()
    args.conversations, args.turns = (8, 3) if args.quick else (12, 4)
    args.user_tokens, args.output_tokens = 32, 16
    # Contexts together about 3x the pool at the last turn: each conversation's first prompt takes its share.
    pool_tokens = args.pool_pages * PAGE_SIZE
    args.system_tokens = 3 * pool_tokens // args.conversations - args.turns * (args.user_tokens + args.output_tokens)
    args.distinct_prompts = 3 * args.conversations
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        write_bench_model(model_dir)
        per_page = page_bytes(load_model_config(model_dir), PAGE_SIZE, torch.float32)
        pool_bytes = args.pool_pages * per_page
        offload_bytes = 4 * pool_bytes  # room for the whole working set
        figures = {}
        for name, run in (("multi_turn", multi_turn), ("no_reuse", no_reuse)):
            figures[name] = {}
            for tier in ("off", "on", "off_again"):  # off twice, before and after: the drift between runs shows
                log(f"{name}, host tier {tier}")
                figures[name][tier] = run(model_dir, pool_bytes, offload_bytes if tier == "on" else 0, args)
    turns, reuse = figures["multi_turn"], figures["no_reuse"]
    off_ttft = statistics.mean([turns["off"]["revisit_ttft_p50_s"], turns["off_again"]["revisit_ttft_p50_s"]])
    off_speed = statistics.mean([reuse["off"]["tokens_per_s"], reuse["off_again"]["tokens_per_s"]])
    emit_json({
        "benchmark": "kv_offload",
        "device": args.device,
        "model": {**MODEL_SHAPE, "page_size": PAGE_SIZE},
        "device_pool_pages": args.pool_pages,
        "host_tier_pages": 4 * args.pool_pages,
        "working_set_over_pool": round(args.conversations * (args.system_tokens + args.turns * (
            args.user_tokens + args.output_tokens)) / pool_tokens, 2),  # fmt: skip
        "conversations": args.conversations,
        "turns": args.turns,
        "concurrency": args.concurrency,
        "multi_turn": turns,
        "no_reuse": reuse,
        "revisit_ttft_p50_on_over_off": round(turns["on"]["revisit_ttft_p50_s"] / off_ttft, 3),
        "no_reuse_throughput_on_over_off": round(reuse["on"]["tokens_per_s"] / off_speed, 3),
    }, args.json_out)  # fmt: skip


if __name__ == "__main__":
    main()
