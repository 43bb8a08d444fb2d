"""A tensor-parallel group with a rank process that does not hold the group's secret refuses to start: rank 0's
RankGroup raises naming the rank, and the rank process exits, before any step plan is sent (or a model loaded)."""

from __future__ import annotations

import contextlib
import subprocess

import msgspec
import pytest
import torch

from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.peer_auth import write_secret
from gpu_runtime.tp import rank_group
from gpu_runtime.tp.group_auth import GroupRefused

pytestmark = pytest.mark.daemon


def test_a_rank_with_the_wrong_secret_makes_the_group_refuse_to_start(tmp_path, monkeypatch):
    wrong = write_secret(tmp_path)  # a valid secret file, but not the group's
    real_spec = rank_group.RankSpec
    started = []

    def spec_with_the_wrong_secret(**fields):
        started.append(fields["rank"])
        return real_spec(**{**fields, "secret_path": str(wrong)})

    monkeypatch.setattr(rank_group, "RankSpec", spec_with_the_wrong_secret)
    config = EngineConfig(tensor_parallel_size=2, attention_backend="torch", dtype="float32")
    processes = []
    monkeypatch.setattr(rank_group.RankGroup, "_kill", _recording_kill(processes))
    with pytest.raises(GroupRefused, match="tensor-parallel rank 1 of 2 could not prove it holds the group's secret"):
        rank_group.RankGroup(config, tmp_path / "no-model-is-loaded", torch.device("cpu"), collective_timeout_s=60)
    assert started == [1]
    assert [process.returncode for process in processes] == [1]  # it refused too (or was killed: not 0)


def _recording_kill(processes: list):
    original = rank_group.RankGroup._kill

    def kill(self) -> None:
        for process in self._processes:  # give the rank its own refusal's exit first: it needs no kill
            with contextlib.suppress(subprocess.TimeoutExpired):  # still running: killed below (the test sees -9)
                process.wait(timeout=60)
        processes.extend(self._processes)
        original(self)

    return kill


def test_the_rank_spec_carries_the_secrets_path_not_the_secret():
    fields = {field.name for field in msgspec.structs.fields(rank_group.RankSpec)}
    assert "secret_path" in fields and not {"secret", "token"} & fields
