"""vLLM's own benchmark request functions against `tokend bench`'s client: the same daemon, the same workload
(lengths, arrivals; fresh prompt tokens each run, so the prefix cache favours neither); prints JSON comparing the
TTFT each reports, for chat and completions.

    .venv/bin/python scripts/bench_clients_compare.py --vllm-request-funcs /tmp/endpoint_request_func.py

Only the request function differs between the two runs: both go through tokend bench's runner (arrival times,
concurrency, metrics), one with tokend's OpenAIBackend, one with vLLM's `async_request_openai_completions` /
`async_request_openai_chat_completions` on an aiohttp session as `vllm bench serve` makes them. The rounds alternate
which client goes first, so a drift in the machine's load falls on both.

vLLM is not a dependency (and not installable beside this torch); its request functions are one file that needs only
aiohttp, regex and tqdm. Get it from vLLM's repository, e.g.
    curl -o /tmp/endpoint_request_func.py \\
      https://raw.githubusercontent.com/vllm-project/vllm/main/vllm/benchmarks/lib/endpoint_request_func.py
    .venv/bin/pip install aiohttp regex
(older vLLM releases keep the same functions in benchmarks/backend_request_func.py; either file works.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from harness.local_daemon import LocalDaemon  # noqa: E402

from daemon.bench.backends import OpenAIBackend, RequestResult  # noqa: E402
from daemon.bench.datasets import BenchRequest, random_dataset, with_prompt_text  # noqa: E402
from daemon.bench.runner import run_benchmark  # noqa: E402
from gpu_runtime.default_model import DEFAULT_MODEL_NAME  # noqa: E402

HOW_TO_GET = __doc__[__doc__.index("vLLM is not a dependency") :]
BYTE_VOCAB = 256  # byte ids decode to text in every tokenizer tokend serves


def log(message: str) -> None:
    print(f"[bench_clients_compare] {message}", file=sys.stderr, flush=True)


def load_vllm_request_funcs(path: Path):
    spec = importlib.util.spec_from_file_location("vllm_endpoint_request_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class VllmClient:
    """vLLM's request function for an endpoint, behind the interface tokend bench's runner drives."""

    def __init__(self, funcs, base_url: str, endpoint: str):
        import aiohttp

        self._funcs = funcs
        self._chat = endpoint == "chat"
        self._url = base_url + ("/v1/chat/completions" if self._chat else "/v1/completions")
        # As vllm bench serve opens its session: one keep-alive connection pool, no connection limit.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), timeout=funcs.AIOHTTP_TIMEOUT
        )

    async def send(self, request: BenchRequest) -> RequestResult:
        func = (
            self._funcs.ASYNC_REQUEST_FUNCS["openai-chat"] if self._chat else self._funcs.ASYNC_REQUEST_FUNCS["openai"]
        )
        given = self._funcs.RequestFuncInput(
            prompt=request.prompt_text if self._chat else request.prompt_token_ids,
            api_url=self._url,
            prompt_len=len(request.prompt_token_ids),
            output_len=request.output_len,
            model="",
            ignore_eos=True,
            extra_body={"temperature": 0},
        )
        out = await func(request_func_input=given, session=self._session)
        return RequestResult(
            success=out.success, prompt_len=out.prompt_len, output_tokens=out.output_tokens or 0, ttft=out.ttft,
            latency=out.latency, itl=list(out.itl), start_time=getattr(out, "start_time", 0.0),
            generated_text=out.generated_text, error=out.error,
        )  # fmt: skip

    async def close(self) -> None:
        await self._session.close()


async def run_once(client, requests: list[BenchRequest], args: argparse.Namespace) -> dict:
    try:
        return await run_benchmark(client, requests, args.request_rate, 1.0, args.max_concurrency, args.seed, {},
                                   progress=False, percentiles=(50.0, 99.0))  # fmt: skip
    finally:
        await client.close()


async def compare(funcs, base_url: str, endpoint: str, args: argparse.Namespace) -> dict:
    runs_made = iter(range(1_000_000))

    def workload() -> list[BenchRequest]:
        # Fresh prompts for every run, of the same lengths: a prompt the daemon has seen would hit its prefix cache
        # and make whichever client came second look faster.
        seed = args.seed + 1000 * next(runs_made)
        requests = random_dataset(args.num_prompts, BYTE_VOCAB, args.input_len, args.output_len, 0.0, seed)
        return with_prompt_text(requests, None, seed) if endpoint == "chat" else requests

    clients = {
        "tokend_bench": lambda: OpenAIBackend(base_url, "", None, endpoint),
        "vllm": lambda: VllmClient(funcs, base_url, endpoint),
    }
    runs: dict[str, list[dict]] = {name: [] for name in clients}
    for make in clients.values():  # warm-up: first-request costs (connections, compiled shapes) fall on neither
        await run_once(make(), workload()[:8], args)
    for round_index in range(args.rounds):
        order = list(clients) if round_index % 2 == 0 else list(reversed(clients))
        for name in order:
            result = await run_once(clients[name](), workload(), args)
            if result["failed"]:
                raise SystemExit(f"{name} {endpoint}: {result['failed']} failed: {set(result['errors']) - {''}}")
            runs[name].append(result)
            log(f"{endpoint} round {round_index} {name}: mean TTFT {result['mean_ttft_ms']:.1f} ms")
    summary = {
        name: {stat: statistics.mean(r[f"{stat}_ttft_ms"] for r in results) for stat in ("mean", "median", "p99")}
        | {
            "mean_tpot_ms": statistics.mean(r["mean_tpot_ms"] for r in results),
            "mean_ttft_ms_per_round": [round(r["mean_ttft_ms"], 2) for r in results],
            "total_output_tokens": results[0]["total_output_tokens"],
        }  # fmt: skip
        for name, results in runs.items()
    }
    ratio = summary["tokend_bench"]["mean"] / summary["vllm"]["mean"]
    return {**summary, "tokend_over_vllm_mean_ttft": ratio, "within_10_percent": abs(ratio - 1) <= 0.10}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-request-funcs", type=Path, help="vLLM's endpoint_request_func.py (see --help)")
    parser.add_argument("--base-url", default=None, help="a running gateway; default: start a daemon")
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="the model the started daemon serves")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument(
        "--max-concurrency", type=int, default=1,
        help="requests in flight at once; 1 (the default) measures TTFT without queueing, which on a small shared "
        "machine would drown the clients' difference in noise",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4, help="runs per client and endpoint, alternating order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.vllm_request_funcs is None or not args.vllm_request_funcs.is_file():
        print(f"bench_clients_compare: --vllm-request-funcs FILE is needed.\n\n{HOW_TO_GET}", file=sys.stderr)
        return 2
    funcs = load_vllm_request_funcs(args.vllm_request_funcs)

    async def both(url: str) -> dict:
        return {endpoint: await compare(funcs, url, endpoint, args) for endpoint in ("completions", "chat")}

    names = ("num_prompts", "input_len", "output_len", "request_rate", "max_concurrency", "rounds")
    workload = {k: getattr(args, k) for k in names}
    if args.base_url:
        results = asyncio.run(both(args.base_url.rstrip("/")))
    else:
        log(f"starting a daemon serving {args.model}")
        with LocalDaemon("--model", args.model) as daemon:
            results = asyncio.run(both(daemon.http_url))
    print(json.dumps({"workload": workload | {"model": args.model}, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
