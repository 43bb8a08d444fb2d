"""`tokend bench` against a real daemon: vLLM's printed table, result file and metrics, figures that agree with the
server's own; `tokend tokenizer-path` for the clients that count tokens themselves."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon_harness import ROOT, Daemon

from daemon.bench import datasets
from daemon.bench.backends import RequestResult
from daemon.bench.metrics import summarize
from daemon.bench.runner import arrival_gaps

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 24, 40, 20
# The lines vLLM's `bench serve` prints (vllm/benchmarks/serve.py), in its order.
VLLM_TABLE = [
    "============ Serving Benchmark Result ============",
    "Successful requests:", "Failed requests:", "Request rate configured (RPS):", "Benchmark duration (s):",
    "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):", "Request goodput (req/s):",
    "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
    "Total token throughput (tok/s):",
    "---------------Time to First Token----------------", "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):",
    "---------------Inter-token Latency----------------", "Mean ITL (ms):", "Median ITL (ms):", "P99 ITL (ms):",
    "----------------End-to-end Latency----------------", "Mean E2EL (ms):", "Median E2EL (ms):", "P99 E2EL (ms):",
    "==================================================",
]  # fmt: skip
# The keys of vLLM's result file (with --save-detailed), less the ones tokend has no use for (rtfx, queue_times).
VLLM_KEYS = [
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
] + [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "std", "p99")]
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts", "errors")


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def _tokend(*args: str) -> str:
    command = [sys.executable, "-m", "daemon.cli", *args]
    return subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300).stdout


@pytest.mark.parametrize("target", ["completions", "chat", "grpc"])
def test_the_result_is_vllms_and_agrees_with_the_server(daemon, tmp_path, target):
    generated_before = daemon.metric("tokend:generation_tokens_total")
    ttft_sum_before = daemon.metric("tokend:time_to_first_token_seconds_sum")
    ttft_count_before = daemon.metric("tokend:time_to_first_token_seconds_count")
    flags = ["--address", daemon.address] if target == "grpc" else ["--base-url", daemon.http_url, "--endpoint", target]
    printed = _tokend(
        "bench", *flags, "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
        "--random-output-len", str(OUTPUT_LEN), "--request-rate", "50", "--goodput", "e2el:60000",
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
        "--no-progress",
    )  # fmt: skip
    labels = [line.split(":")[0] + ":" if ":" in line else line for line in printed.splitlines()]
    assert labels == VLLM_TABLE
    result = json.loads((tmp_path / "r.json").read_text())
    assert [key for key in result if key in VLLM_KEYS] == VLLM_KEYS  # in vLLM's order, tokend's own keys aside
    assert result["backend"] == {"completions": "openai", "chat": "openai-chat", "grpc": "grpc"}[target]
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
    for key in PER_REQUEST:
        assert len(result[key]) == NUM_PROMPTS, key
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(len(gaps) < OUTPUT_LEN for gaps in result["itls"])  # a chunk per token, or fewer carrying several
    assert result["errors"] == [""] * NUM_PROMPTS and any(result["generated_texts"])  # a random model: some empty
    if target == "chat":  # the server's count: the words plus the chat template's tokens
        assert all(n > INPUT_LEN for n in result["input_lens"])
    else:
        assert result["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    assert result["total_input_tokens"] == sum(result["input_lens"])
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # a 60 s SLO: all good
    assert 1 <= result["max_concurrent_requests"] <= NUM_PROMPTS
    assert 1 <= result["max_output_tokens_per_s"] <= result["total_output_tokens"]
    # The server counted the same tokens, and saw each first token no later than the client did.
    daemon.wait_for(
        lambda: daemon.metric("tokend:generation_tokens_total") - generated_before == result["total_output_tokens"],
        timeout=5,
    )
    server_ttft_ms = 1e3 * (daemon.metric("tokend:time_to_first_token_seconds_sum") - ttft_sum_before)
    server_ttft_ms /= daemon.metric("tokend:time_to_first_token_seconds_count") - ttft_count_before
    assert result["mean_ttft_ms"] >= server_ttft_ms


def test_without_save_detailed_the_file_keeps_only_the_summary_under_vllms_name(daemon, tmp_path):
    _tokend("bench", "--address", daemon.address, "--dataset-name", "mixed-priority", "--num-prompts", "8",
            "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "4", "--save-result",
            "--result-dir", str(tmp_path), "--metric-percentiles", "50,90", "--no-progress")  # fmt: skip
    [saved] = tmp_path.glob("grpc-infqps-concurrency4-default-*.json")
    result = json.loads(saved.read_text())
    assert result["completed"] == 8 and result["max_concurrency"] == 4
    assert result["max_concurrent_requests"] <= 4
    assert set(PER_REQUEST) & set(result) == {"latencies"}  # what vLLM keeps without --save-detailed
    assert {"p50_ttft_ms", "p90_ttft_ms"} <= set(result) and "p99_ttft_ms" not in result


def test_tokenizer_path_prints_a_directory_transformers_loads_and_bench_uses(daemon, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
    default = _tokend("tokenizer-path").strip()
    assert transformers.AutoTokenizer.from_pretrained(default).encode("Hello world")  # SmolLM2's, converted
    tiny = _tokend("tokenizer-path", "--model", "tokend-tiny-random").strip()
    assert len(transformers.AutoTokenizer.from_pretrained(tiny)) == 258
    _tokend("bench", "--base-url", daemon.http_url, "--endpoint", "chat", "--tokenizer", tiny, "--num-prompts", "4",
            "--random-input-len", "12", "--random-output-len", "4", "--json-out", str(tmp_path / "r.json"),
            "--no-progress")  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 4 and result["tokenizer_id"] == tiny


def test_peak_output_rate_and_concurrency_are_counted_as_vllm_counts_them():
    # Two requests overlapping in [1, 2): chunks at 0.5, 1.2, 1.4 (first) and 1.5, 1.7, 2.5 (second).
    first = RequestResult(success=True, output_tokens=3, start_time=0.0, ttft=0.5, itl=[0.7, 0.2], latency=1.4)
    second = RequestResult(success=True, output_tokens=3, start_time=1.0, ttft=0.5, itl=[0.2, 0.8], latency=1.5)
    result = summarize([first, second, RequestResult(error="HTTP 500")], duration=2.5, goodput_slos_ms={})
    assert result["max_output_tokens_per_s"] == 4  # the second [1, 2) holds 1.2, 1.4, 1.5, 1.7
    assert result["max_concurrent_requests"] == 2
    assert result["output_lens"] == [3, 3, 0] and result["failed"] == 1
    assert result["mean_tpot_ms"] == pytest.approx(1e3 * (0.45 + 0.5) / 2)


def test_workloads_and_arrivals_repeat_from_the_seed():
    assert datasets.long_tail_dataset(20, 258, seed=3) == datasets.long_tail_dataset(20, 258, seed=3)
    assert datasets.long_tail_dataset(20, 258, seed=3) != datasets.long_tail_dataset(20, 258, seed=4)
    assert datasets.prefix_repetition_dataset(5, 258, seed=1) == datasets.prefix_repetition_dataset(5, 258, seed=1)
    assert arrival_gaps(50, 4.0, 0.5, seed=7) == arrival_gaps(50, 4.0, 0.5, seed=7)
    gaps = arrival_gaps(4000, 4.0, 1.0, seed=7)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # Poisson at 4 requests/s
    outputs = [r.output_len for r in datasets.long_tail_dataset(2000, 258, seed=0)]
    assert 110 < sum(outputs) / len(outputs) < 135 and max(outputs) <= 1024
