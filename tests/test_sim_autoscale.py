"""scripts/sim_autoscale.py --smoke: the JSON a reader of docs/benchmarks/autoscale.json relies on, and tokend's
policy meeting the TTFT target on the step burst at least as often as the two reactive policies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = {"utilisation", "ongoing_requests", "reactive_ttft", "tokend"}


def test_smoke_run_reports_every_trace_and_policy(tmp_path):
    # Fixed coefficients: measuring the engine is the full run's job, and it would make the suite's run vary.
    command = [sys.executable, str(ROOT / "scripts" / "sim_autoscale.py"), "--smoke", "--step-ms-base", "11.4",
               "--step-ms-per-token", "0.358", "--plot-dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert set(report["traces"]) == {"step_burst", "sinusoid", "bursty_poisson"}
    params = report["params"]
    assert params["step_model"] == {"source": "flags", "base_ms": 11.4, "per_token_ms": 0.358}
    for by_policy in report["traces"].values():
        assert set(by_policy) == POLICIES
        for run in by_policy.values():
            assert 0 <= run["ttft_attainment"] <= 1 and run["worker_seconds"] > 0
            assert run["requests"] > 0 and run["scale_ups"] >= 0
            assert set(run["by_warmup_s"]) == {f"{w:g}" for w in params["warmups_s"]}
    burst = report["traces"]["step_burst"]
    for reactive in ("utilisation", "reactive_ttft"):
        assert burst["tokend"]["ttft_attainment"] >= burst[reactive]["ttft_attainment"], reactive
    assert burst["tokend"]["decisions"].get("up:ttft", 0) + burst["tokend"]["decisions"].get("up:queue", 0) >= 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert {Path(p).name for p in report["plots"]} == {"autoscale-workers.png", "autoscale-attainment.png"}
