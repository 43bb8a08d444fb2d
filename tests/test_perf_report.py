"""The performance report regenerates from one command: real daemons measured, the JSON rendered into
PERFORMANCE.md with its plot. Run here at a tiny scale (the embedded model, a handful of prompts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from daemon_harness import ROOT

from daemon.bench.datasets import long_tail_dataset
from gpu_runtime.default_model import ensure_tiny_random_model

NUM_PROMPTS, MAX_OUTPUT = 4, 12


def test_one_command_measures_every_mode_and_writes_the_report(tmp_path):
    report, out_dir = tmp_path / "docs" / "PERFORMANCE.md", tmp_path / "docs" / "serving"
    report.parent.mkdir()
    command = [
        sys.executable, "scripts/perf_report.py", "--model", str(ensure_tiny_random_model()),
        "--num-prompts", str(NUM_PROMPTS), "--sweep-prompts", "2", "--rates", "8",
        "--max-output-len", str(MAX_OUTPUT), "--max-num-seqs", "2", "--seed", "3",
        "--out-dir", str(out_dir), "--report", str(report),
    ]  # fmt: skip
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300)

    result = json.loads((out_dir / "serving_compare.json").read_text())
    expected_output = sum(r.output_len for r in long_tail_dataset(NUM_PROMPTS, 258, 3, max_output=MAX_OUTPUT))
    for mode in ("continuous", "static", "one-at-a-time"):
        saturation = result["results"][mode]["saturation"]
        assert (saturation["completed"], saturation["failed"]) == (NUM_PROMPTS, 0)
        assert saturation["total_output_tokens"] == expected_output  # every mode served the same work
    assert result["continuous_vs_static"] == (
        result["saturation_output_tokens_per_s"]["continuous"] / result["saturation_output_tokens_per_s"]["static"]
    )

    text = report.read_text()
    assert f"{result['saturation_output_tokens_per_s']['continuous']:,.0f}" in text
    assert f"**{math.floor(result['continuous_vs_static'] * 100) / 100:.2f}x**" in text  # cut, never rounded up
    assert result["workload"]["saturation"]["sha256"] in text
    assert f"serving the checkpoint `{ensure_tiny_random_model()}`" in text
    plot = out_dir / result["figures"][0]
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert f"](serving/{result['figures'][0]})" in text  # the image link resolves from the report's folder
