"""`tokend bench` against a real daemon: vLLM's metric names, and figures that agree with the server's own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon_harness import ROOT, Daemon

from daemon.bench import datasets
from daemon.bench.runner import arrival_gaps

NUM_PROMPTS, OUTPUT_LEN = 24, 20


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def _bench(tmp_path, *flags: str) -> dict:
    out = tmp_path / "result.json"
    command = [sys.executable, "-m", "daemon.cli", "bench", *flags, "--json-out", str(out), "--no-progress"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300)
    return json.loads(out.read_text())


@pytest.mark.parametrize("target", ["http", "grpc"])
def test_the_result_has_vllms_metrics_and_agrees_with_the_server(daemon, tmp_path, target):
    generated_before = daemon.metric("tokend:generation_tokens_total")
    ttft_sum_before = daemon.metric("tokend:time_to_first_token_seconds_sum")
    ttft_count_before = daemon.metric("tokend:time_to_first_token_seconds_count")
    flags = ["--base-url", daemon.http_url] if target == "http" else ["--grpc", daemon.address]
    result = _bench(
        tmp_path, *flags, "--num-prompts", str(NUM_PROMPTS), "--random-input-len", "40",
        "--random-output-len", str(OUTPUT_LEN), "--request-rate", "50", "--goodput", "e2el:60000",
    )  # fmt: skip
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in result
    assert (result["completed"], result["failed"]) == (NUM_PROMPTS, 0)
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] == NUM_PROMPTS * 40
    assert result["output_throughput"] == pytest.approx(result["total_output_tokens"] / result["duration"])
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])  # a 60 s SLO: all good
    # The server counted the same tokens, and saw each first token no later than the client did.
    daemon.wait_for(
        lambda: daemon.metric("tokend:generation_tokens_total") - generated_before == result["total_output_tokens"],
        timeout=5,
    )
    server_ttft_ms = 1e3 * (daemon.metric("tokend:time_to_first_token_seconds_sum") - ttft_sum_before)
    server_ttft_ms /= daemon.metric("tokend:time_to_first_token_seconds_count") - ttft_count_before
    assert result["mean_ttft_ms"] >= server_ttft_ms


def test_mixed_priority_runs_over_grpc(daemon, tmp_path):
    result = _bench(tmp_path, "--grpc", daemon.address, "--dataset-name", "mixed-priority", "--num-prompts", "8",
                    "--random-input-len", "16", "--random-output-len", "8", "--max-concurrency", "4")  # fmt: skip
    assert result["completed"] == 8 and result["max_concurrency"] == 4


def test_workloads_and_arrivals_repeat_from_the_seed():
    assert datasets.long_tail_dataset(20, 258, seed=3) == datasets.long_tail_dataset(20, 258, seed=3)
    assert datasets.long_tail_dataset(20, 258, seed=3) != datasets.long_tail_dataset(20, 258, seed=4)
    assert datasets.prefix_repetition_dataset(5, 258, seed=1) == datasets.prefix_repetition_dataset(5, 258, seed=1)
    assert arrival_gaps(50, 4.0, 0.5, seed=7) == arrival_gaps(50, 4.0, 0.5, seed=7)
    gaps = arrival_gaps(4000, 4.0, 1.0, seed=7)
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)  # Poisson at 4 requests/s
    outputs = [r.output_len for r in datasets.long_tail_dataset(2000, 258, seed=0)]
    assert 110 < sum(outputs) / len(outputs) < 135 and max(outputs) <= 1024
