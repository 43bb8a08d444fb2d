"""Rollout paths in process, as the daemon checks an Admin.Rollout over a pool of fake workers: absolute only,
resolved once (symlinks too), inside model_roots (by default the configured models' directories and the model
cache), and reported resolved."""

from __future__ import annotations

import os

import pytest
from worker_fakes import FakeChildren, FakeClock, FakeLog

from common.lanes import RolloutPhase
from daemon.config import ServeConfig
from daemon.rollout_commands import handle_rollout
from daemon.worker_pool import WorkerPool
from frontend.control_messages import RolloutCommand
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME

pytestmark = pytest.mark.fast


def _checkpoint(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def models(tmp_path):
    """/models/A (served), /models/B beside it, /elsewhere/C outside, and links from inside to each."""
    a, b = _checkpoint(tmp_path / "models" / "A"), _checkpoint(tmp_path / "models" / "B")
    outside = _checkpoint(tmp_path / "elsewhere" / "C")
    os.symlink(outside, tmp_path / "models" / "to-outside")
    os.symlink(b, tmp_path / "models" / "to-B")
    return tmp_path / "models", a, b, outside


def _pool(tmp_path, model, device: str = "cpu,cpu", **options) -> WorkerPool:
    config = ServeConfig(model=(str(model),), served_model_name="m", device=device, state_dir=str(tmp_path),
                         **options)  # fmt: skip
    pool = WorkerPool(config, tmp_path, FakeLog(), FakeChildren(), FakeClock())
    pool.start_all()
    return pool


def _rollout(pool: WorkerPool, path: str):
    return handle_rollout(pool, RolloutCommand("c1", "m", path, strategy="in-place"))


def test_a_relative_path_is_refused_naming_path(tmp_path, models, monkeypatch):
    root, a, _, _ = models
    monkeypatch.chdir(root)  # even where it would resolve to a real checkpoint
    result = _rollout(_pool(tmp_path, a), "B")
    assert (result.code, result.error.split(":")[0]) == ("INVALID_ARGUMENT", "path")


@pytest.mark.parametrize("name", ["elsewhere/C", "models/to-outside", "models/A/../../elsewhere/C"])
def test_a_path_outside_the_roots_is_refused_naming_model_roots(tmp_path, models, name):
    result = _rollout(_pool(tmp_path, models[1]), str(tmp_path / name))
    assert (result.code, result.error.split(":")[0]) == ("FAILED_PRECONDITION", "model_roots")
    assert str(models[3]) in result.error  # what it resolved to


def test_a_path_beside_the_configured_model_is_taken_and_reported_resolved(tmp_path, models):
    root, a, b, _ = models
    pool = _pool(tmp_path, a)
    result = _rollout(pool, str(root / "to-B"))
    assert result.error == "" and result.rollout.path == str(b)
    assert pool.rollouts["m"].phase is RolloutPhase.ROLLING and pool.rollouts["m"].path == str(b)


def test_model_roots_replace_the_default(tmp_path, models):
    root, a, b, outside = models
    pool = _pool(tmp_path, a, model_roots=(str(outside.parent),))
    assert _rollout(pool, str(b)).error.startswith("model_roots:")
    assert _rollout(pool, str(outside)).error == ""


def test_a_missing_path_inside_the_roots_is_refused_naming_path_and_a_built_in_passes(tmp_path, models):
    root, a, _, _ = models
    pool = _pool(tmp_path, a)
    assert _rollout(pool, str(root / "missing")).error.startswith("path:")
    assert _rollout(pool, TINY_RANDOM_MODEL_NAME).error == ""


def test_model_roots_must_be_absolute():
    with pytest.raises(ValueError, match="^model_roots:"):
        ServeConfig(model_roots=("models",))


def test_a_p_d_surge_needs_a_spare_group_for_the_decode_pool_and_no_strategy_goes_in_place(tmp_path, models):
    """A spare prefill group alone cannot take the routed pool's new worker: a surge is refused, naming the field,
    and a rollout that names no strategy goes in place. (Moved from test_disaggregated.py's daemon test; the
    refusal's way to the client as FAILED_PRECONDITION is test_rollout_commands.py's, end to end.)"""
    _, a, b, _ = models
    pool = _pool(tmp_path, a, device="cpu=prefill,cpu=decode", spare_devices="cpu=prefill",
                 disagg_min_prompt_tokens=16)  # fmt: skip
    refused = handle_rollout(pool, RolloutCommand("c1", "m", str(b), strategy="surge"))
    assert refused.code == "FAILED_PRECONDITION" and refused.error.startswith("strategy: surge needs a free group")
    assert pool.rollouts["m"].phase is RolloutPhase.NONE
    taken = handle_rollout(pool, RolloutCommand("c2", "m", str(b)))
    assert taken.error == "" and (taken.rollout.phase, taken.rollout.strategy) == ("rolling", "in-place")
