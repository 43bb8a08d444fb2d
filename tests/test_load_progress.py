"""Model loading says how far it got: a bar on a terminal, occasional JSON log lines in the daemon's log, and
nothing at all where nobody set logging up (the offline API piped into a file, CI)."""

from __future__ import annotations

import io

import pytest
import structlog
from structlog.testing import capture_logs

from gpu_runtime.default_model import ensure_tiny_random_model
from gpu_runtime.model import load_progress
from gpu_runtime.model.loader import iterate_checkpoint, safetensors_files


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def model_dir():
    return ensure_tiny_random_model()


@pytest.fixture
def structlog_reset():
    yield
    structlog.reset_defaults()  # capture_logs leaves structlog marked as configured


def _load_all(model_dir) -> int:
    return sum(tensor.numel() * tensor.element_size() for _, tensor in iterate_checkpoint(model_dir))


def test_in_a_log_a_long_load_reports_its_bytes_and_ends_with_one_summary(model_dir, monkeypatch, structlog_reset):
    monkeypatch.setattr(load_progress, "LOG_EVERY_S", 0.0)  # every tensor is "a while" later
    with capture_logs() as entries:
        loaded = _load_all(model_dir)
    total = sum(load_progress.weight_bytes(path) for path in safetensors_files(model_dir))
    assert loaded == total
    steps = [e for e in entries if e["event"] == "loading_weights"]
    assert steps and all(e["total_bytes"] == total and e["model"] == model_dir.name for e in steps)
    assert [e["bytes"] for e in steps] == sorted(e["bytes"] for e in steps) and steps[-1]["bytes"] == total
    (summary,) = [e for e in entries if e["event"] == "weights_loaded"]
    assert summary["bytes"] == total and summary["files"] == 1


def test_a_quick_load_logs_only_its_summary(model_dir, structlog_reset):
    with capture_logs() as entries:
        _load_all(model_dir)
    assert [e["event"] for e in entries] == ["weights_loaded"]


def test_on_a_terminal_a_bar_names_the_model(model_dir, monkeypatch):
    monkeypatch.setattr(load_progress, "BAR_DELAY_S", 0.0)
    terminal = Terminal()
    with load_progress.LoadProgress(model_dir, safetensors_files(model_dir), stream=terminal) as progress:
        progress.advance(progress.total)
    assert f"loading {model_dir.name}" in terminal.getvalue()


def test_without_a_terminal_or_logging_it_is_silent(model_dir, capsys):
    assert not structlog.is_configured()
    quiet = io.StringIO()
    with load_progress.LoadProgress(model_dir, safetensors_files(model_dir), stream=quiet) as progress:
        progress.advance(progress.total)
    _load_all(model_dir)
    assert quiet.getvalue() == ""
    assert capsys.readouterr() == ("", "")
