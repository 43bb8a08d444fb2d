"""The chaos run (tests/chaos/, behind scripts/chaos.py) with tiny counts against a real daemon: nothing is lost."""

from __future__ import annotations

import json

import pytest
from chaos.cli import main

pytestmark = pytest.mark.chaos

FUZZ_INPUTS, FAULTS = 70, 3
LOSS_KINDS = {"five_xx", "hung", "cut_streams", "ledger_missing", "ledger_wrong"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pd", [False, True], ids=["one-worker", "prefill-decode"])
def test_a_short_chaos_run_reports_json_and_loses_nothing(tmp_path, capsys, pd):
    """With --pd the daemon has a prefill and a decode worker, and the KV pull socket is fuzzed too."""
    out = tmp_path / "chaos.json"
    # In this process, so that the daemon's context manager cleans its processes up whatever happens.
    flags = ["--fuzz-inputs", str(FUZZ_INPUTS), "--faults", str(FAULTS), "--seed", "1", "--out", str(out)]
    exit_code = main([*flags, "--no-progress", *(["--pd"] if pd else [])])
    report = json.loads(capsys.readouterr().out)

    assert json.loads(out.read_text()) == report
    assert report["config"]["fuzz_inputs"] == FUZZ_INPUTS and report["config"]["seed"] == 1
    tried, skipped = report["inputs_tried"], report["inputs_skipped"]
    assert set(tried) >= {"http_completions_body", "http_headers", "grpc_messages", "grpc_raw_bytes"}
    assert sum(tried.values()) + sum(skipped.values()) == FUZZ_INPUTS
    assert all(sum(report["outcomes"][surface].values()) == count for surface, count in tried.items())
    assert [(f["kind"], f["process"]) for f in report["faults_injected"]] == [
        ("kill", "scheduler"),
        ("stop", "frontend"),
        ("kill", "gateway"),
    ]
    assert report["outcomes"]["load_grpc"].get("complete") and report["outcomes"]["load_http"].get("complete")
    assert set(report["lost"]) >= LOSS_KINDS
    hardened = report["hardened_surfaces"]
    assert set(hardened) == {"rollout_paths", "gguf_files", "control_channel", *(["kv_socket"] if pd else [])}
    for name, counts in hardened.items():
        expected = counts["refused_as_expected"] + counts.get("read_as_expected", 0)
        assert counts["incidents"] == 0 and counts["inputs_sent"] == expected > 0, (name, counts)
    lost = {kind: bucket for kind, bucket in report["lost"].items() if bucket["count"]}
    assert not lost, json.dumps(lost, indent=1)[:4000]
    assert report["ok"] is True and exit_code == 0
