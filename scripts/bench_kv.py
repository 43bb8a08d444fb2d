"""KV cache manager benchmark: prefix caching, shared pages, paged concurrency, chunked prefill, TTFT projection.

Prints one JSON object; each figure is measured side by side in this one run. Usage:
    .venv/bin/python scripts/bench_kv.py [--quick] [--json-out FILE]
Requests arrive on a wall-clock schedule while the engine steps, as a server would see them, so
time-to-first-token and inter-token latency are measured from arrival, not from submission of a batch.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_engine import MODEL_SHAPE, emit_json, write_bench_model  # noqa: E402

from daemon.bench.metrics import percentile  # noqa: E402
from gpu_runtime import EngineConfig, LLMEngine, SamplingParams  # noqa: E402

VOCAB = MODEL_SHAPE["vocab_size"]


def log(message: str) -> None:
    print(f"[bench_kv] {message}", file=sys.stderr, flush=True)


@dataclass
class Arrival:
    at: float  # seconds after the run starts
    request_id: str
    prompt: list[int]
    max_tokens: int


@dataclass
class Record:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    projected_ttft: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def simulate(engine: LLMEngine, arrivals: list[Arrival], project: bool = False) -> dict[str, Record]:
    """Feeds `arrivals` on their schedule while stepping the engine; records every token's time."""
    pending = sorted(arrivals, key=lambda a: a.at)
    records: dict[str, Record] = {}
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].at <= now:
            arrival = pending.pop(0)
            params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(arrival.request_id, arrival.prompt, params)
            records[arrival.request_id] = Record(arrival=start + arrival.at)
            if project:
                records[arrival.request_id].projected_ttft = engine.scheduler.projected_ttft_seconds().get(
                    arrival.request_id
                )
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - (time.monotonic() - start)))
            continue
        for out in engine.step():
            record = records[out.request_id]
            record.token_times.extend([time.monotonic()] * len(out.new_token_ids))
            record.num_cached_tokens = out.num_cached_tokens
    return records


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def poisson_schedule(rng: random.Random, count: int, rate: float, burstiness: float = 1.0) -> list[float]:
    """Arrival times with gamma-distributed gaps (burstiness 1 = Poisson; lower = burstier)."""
    times, now = [], 0.0
    for _ in range(count):
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


def engine_for(model_dir: Path, **options) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(model_dir), **options))
    engine.add_request("warm-up", list(range(1, 64)), SamplingParams(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def prefix_repetition(model_dir: Path, quick: bool, rate: float) -> dict:
    """vLLM's prefix_repetition shape: 10 prefixes of 256 tokens, unique 256-token suffixes, 128 outputs.

    Poisson arrivals at `rate` requests/s; time to first token is measured from each arrival.
    """
    rng = random.Random(1)
    per_prefix = 4 if quick else 10  # vLLM's shape: num_prompts / num_prefixes requests per prefix
    prefixes = [tokens(rng, 256) for _ in range(10)]
    prompts = [p + tokens(rng, 256) for p in prefixes for _ in range(per_prefix)]
    rng.shuffle(prompts)
    times = poisson_schedule(rng, len(prompts), rate=rate)
    arrivals = [Arrival(t, f"r{i}", p, 128) for i, (t, p) in enumerate(zip(times, prompts, strict=True))]
    result = {
        "requests": len(prompts),
        "request_rate": rate,
        "unique_prompt_tokens_minimum": 10 * 256 + len(prompts) * 256,
    }
    for caching in (True, False):
        log(f"prefix repetition at {rate} requests/s, caching {'on' if caching else 'off'}")
        engine = engine_for(model_dir, max_num_seqs=16, enable_prefix_caching=caching)
        computed_before = engine.stats.num_prefill_tokens
        records = simulate(engine, arrivals)
        ttfts = [r.ttft for r in records.values()]
        result["caching_on" if caching else "caching_off"] = {
            "prefill_tokens_computed": engine.stats.num_prefill_tokens - computed_before,
            "p50_ttft_ms": ms(statistics.median(ttfts)),
            "p99_ttft_ms": ms(percentile(ttfts, 99)),
        }
    on, off = result["caching_on"], result["caching_off"]
    on["prefill_over_minimum"] = round(on["prefill_tokens_computed"] / result["unique_prompt_tokens_minimum"], 4)
    result["p50_ttft_off_over_on"] = round(off["p50_ttft_ms"] / on["p50_ttft_ms"], 2)
    return result


def shared_prompt_pages(model_dir: Path, num_requests: int = 16) -> dict:
    """N requests sharing a 512-token prompt (plus a short unique tail each) hold its pages once."""
    log("shared 512-token prompt")
    rng = random.Random(2)
    shared = tokens(rng, 512)
    engine = engine_for(model_dir, max_num_seqs=num_requests, enable_prefix_caching=True)
    engine.kv.allocator.evict_all_cached()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    engine.add_request("leader", shared + tokens(rng, 20), params)
    engine.step()
    for i in range(num_requests - 1):
        engine.add_request(f"r{i}", shared + tokens(rng, 20), params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv.num_used_pages)
    shared_pages = 512 // 16
    unique_pages = -(-(20 + 32) // 16)
    bound = shared_pages + num_requests * unique_pages + num_requests
    return {
        "requests": num_requests,
        "peak_pages_in_use": peak,
        "bound_shared_plus_n_unique_plus_n": bound,
        "without_sharing_would_need": num_requests * (-(-(512 + 20 + 32) // 16)),
        "holds": peak <= bound,
    }


def paged_concurrency(model_dir: Path, quick: bool) -> dict:
    """Peak concurrent sequences for a fixed KV budget vs reserving max_model_len per request up front."""
    log("peak concurrency for a fixed KV budget")
    rng = random.Random(3)
    budget_tokens = 16384
    engine = engine_for(
        model_dir,
        max_num_seqs=256,
        max_model_len=2048,
        kv_cache_bytes=budget_tokens * 2 * 6 * 4 * 64 * 4,  # K and V, 6 layers, 4 KV heads of 64, float32
        max_num_batched_tokens=8192,
    )
    max_model_len = engine.model_config.max_model_len
    count = 96 if quick else 160
    for i in range(count):
        prompt_len = rng.randint(32, 512)
        output_len = min(1024, max(1, round(rng.expovariate(1 / 128))))
        params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", tokens(rng, prompt_len), params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    contiguous = budget_tokens // max_model_len
    return {
        "kv_budget_tokens": engine.kv.num_pages * engine.kv.page_size,
        "max_model_len": max_model_len,
        "peak_concurrent_paged": peak,
        "concurrent_if_reserving_max_len": contiguous,
        "ratio": round(peak / contiguous, 2),
        "preemptions": engine.stats.num_preemptions,
    }


def chunked_prefill(model_dir: Path, quick: bool) -> dict:
    """16 decode streams running while 4,096-token prompts arrive: inter-token latency with and without chunks."""
    rng = random.Random(4)
    streams = [Arrival(0.0, f"s{i}", tokens(rng, 64), 160 if quick else 240) for i in range(16)]
    long_prompts = [Arrival(2.0 + 4.0 * i, f"long{i}", tokens(rng, 4096), 16) for i in range(2 if quick else 3)]
    result = {}
    for chunked in (True, False):
        log(f"chunked prefill {'on' if chunked else 'off'}")
        # Unchunked, the budget must hold a whole prompt, as vLLM requires; chunked, 512 tokens a step.
        budget = 512 if chunked else 8192
        engine = engine_for(model_dir, max_num_seqs=32, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
        started = time.monotonic()
        records = simulate(engine, streams + long_prompts)
        seconds = time.monotonic() - started
        itls = [gap for rid, r in records.items() if rid.startswith("s") for gap in r.itls]
        output_tokens = sum(len(r.token_times) for r in records.values())
        result["chunked" if chunked else "unchunked"] = {
            "p50_itl_ms": ms(statistics.median(itls)),
            "p99_itl_ms": ms(percentile(itls, 99)),
            "max_itl_ms": ms(max(itls)),
            "output_tokens_per_s": round(output_tokens / seconds, 1),
        }
    on, off = result["chunked"], result["unchunked"]
    result["p99_itl_unchunked_over_chunked"] = round(off["p99_itl_ms"] / on["p99_itl_ms"], 2)
    result["throughput_chunked_over_unchunked"] = round(on["output_tokens_per_s"] / off["output_tokens_per_s"], 3)
    return result


def ttft_projection(model_dir: Path, quick: bool) -> dict:
    """Projected TTFT (at arrival) vs measured, under bursty (gamma, burstiness 0.25) arrivals."""
    log("projected vs measured time to first token")
    rng = random.Random(5)
    engine = engine_for(model_dir, max_num_seqs=16, max_num_batched_tokens=1024)
    for i in range(24):  # let the step-time model see prefill and decode steps before projecting
        engine.add_request(f"w{i}", tokens(rng, rng.randint(16, 400)), SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        engine.step()
    count = 40 if quick else 80
    times = poisson_schedule(rng, count, rate=2.0, burstiness=0.25)
    arrivals = [Arrival(t, f"b{i}", tokens(rng, rng.randint(64, 512)), 64) for i, t in enumerate(times)]
    records = simulate(engine, arrivals, project=True)
    pairs = [(r.projected_ttft, r.ttft) for r in records.values() if r.projected_ttft is not None]
    errors = [abs(p - m) for p, m in pairs]
    return {
        "requests": count,
        "projected": len(pairs),
        "median_abs_error_ms": ms(statistics.median(errors)),
        "median_measured_ttft_ms": ms(statistics.median(m for _, m in pairs)),
        "median_relative_error": round(statistics.median(e / m for e, (_, m) in zip(errors, pairs, strict=True)), 3),
        "p90_abs_error_ms": ms(percentile(errors, 90)),
    }


SECTIONS = ["prefix_repetition", "shared_prompt_pages", "paged_concurrency", "chunked_prefill", "ttft_projection"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument(
        "--prefix-rates", type=float, nargs="+", default=[1.0, 1.5], help="arrival rates for prefix repetition"
    )
    parser.add_argument("--only", choices=SECTIONS, nargs="+", default=SECTIONS, help="run only these figures")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        write_bench_model(model_dir, max_position_embeddings=8192)
        sections = {
            "prefix_repetition": lambda: [prefix_repetition(model_dir, args.quick, r) for r in args.prefix_rates],
            "shared_prompt_pages": lambda: shared_prompt_pages(model_dir),
            "paged_concurrency": lambda: paged_concurrency(model_dir, args.quick),
            "chunked_prefill": lambda: chunked_prefill(model_dir, args.quick),
            "ttft_projection": lambda: ttft_projection(model_dir, args.quick),
        }
        result = {name: sections[name]() for name in args.only}
    emit_json(result, args.json_out)


if __name__ == "__main__":
    main()
