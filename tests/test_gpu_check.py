"""scripts/gpu_check.sh end to end in its CPU dry run: every section prints a JSON line, and every section the CPU can
run passes (fp32 exactness against transformers, bf16 agreement, cache and chunking, seeds, the decode benchmark,
the loader, the pool, the sampler, two engines side by side, the marked GPU tests), CUDA-only figures skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SECTIONS = [
    "environment",
    "exactness_fp32",
    "agreement_bf16",
    "cached_and_chunked",
    "seeds",
    "decode",
    "loader_memory",
    "large_pool",
    "sampler",
    "two_schedulers",
    "tensor_parallel",
    "gpu_tests",
]
CUDA_ONLY = "a CUDA measurement: skipped in the CPU dry run"


def run_check(*flags: str, timeout: float) -> tuple[int, dict[str, dict]]:
    """The check's exit status and its lines by section (each line must parse as JSON)."""
    env = {**os.environ, "TOKEND_GPU_CHECK_PYTHON": sys.executable}  # the suite's Python has what the check needs
    done = subprocess.run([str(SCRIPT), *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, {line["section"]: line for line in lines}


@pytest.fixture(scope="module")
def dry_run():
    return run_check("--dry-run", timeout=1500)


@pytest.mark.timeout(1600)
def test_every_section_prints_one_json_line_and_passes_on_the_cpu(dry_run):
    status, lines = dry_run
    assert list(lines) == [*SECTIONS, "summary"]
    failed = {name: line for name, line in lines.items() if line.get("ok") is False}
    assert not failed, failed
    assert status == 0
    assert lines["summary"]["dry_run"] is True
    assert lines["environment"]["torch"] and lines["environment"]["cuda_available"] is False


@pytest.mark.timeout(1600)
def test_correctness_sections_compare_for_real(dry_run):
    _, lines = dry_run
    for model in ("llama", "qwen2"):
        result = lines["exactness_fp32"]["models"][model]
        assert result["equal"] == result["prompts"] > 0
    bf16 = lines["agreement_bf16"]
    assert bf16["top1_agreement"] >= 0.75  # the bar of 11 of 12 prompts is CUDA's: CPU bfloat16 rounds otherwise
    assert 0 <= bf16["max_abs_delta_logprob"] < 1
    assert lines["cached_and_chunked"]["cached_prompt_tokens"] > 0
    assert lines["cached_and_chunked"]["chunked_equal"] is True
    assert lines["seeds"]["alone_equals_in_batch"] is True
    assert lines["large_pool"]["tokens_equal"] is True
    assert lines["two_schedulers"]["same_tokens"] is True
    (row,) = lines["tensor_parallel"]["rows"]  # two CPU ranks ran decode steps, their collectives timed
    assert row["tp1_step_ms"] > 0 and row["tp2_step_ms"] > 0 and 0 < row["collective_ms"] < row["tp2_step_ms"]


@pytest.mark.timeout(1600)
def test_cuda_only_figures_are_marked_skipped(dry_run):
    _, lines = dry_run
    assert lines["seeds"]["cpu_equals_device"] == {"skipped": CUDA_ONLY}
    assert lines["loader_memory"]["peak_bytes"] == {"skipped": CUDA_ONLY}
    assert lines["sampler"]["syncs_per_call"] == {"skipped": CUDA_ONLY}
    assert set(lines["sampler"]["ms_per_call"]) >= {"greedy", "top_p 0.95", "seeded, top_p 0.9"}
    decode = lines["decode"]
    if "skipped" not in decode:  # the roofline benchmark, when it is there
        assert [row["batch"] for row in decode["decode"]] == [1, 4]
        assert decode["profile"] == {"skipped": CUDA_ONLY}
    assert lines["gpu_tests"]["failures"] == lines["gpu_tests"]["errors"] == 0


@pytest.mark.timeout(300)
def test_without_cuda_and_without_dry_run_it_says_so_and_fails():
    status, lines = run_check(timeout=240)
    assert status == 1
    assert lines["environment"]["cuda_available"] is False
    skipped = [lines[name] for name in SECTIONS[1:]]
    assert all(line["ok"] is False and "--dry-run" in line["skipped"] for line in skipped)
    assert lines["summary"]["ok"] is False
