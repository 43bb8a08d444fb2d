"""Rollout commands as an operator gives them (Admin.Rollout, `tokend rollout`): refusals that name the field, a
canary that splits new requests and is then lifted, a rollback, and new weights that cannot serve."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import ROOT, Daemon
from grpc_health.v1 import health_pb2

from tokend.v1 import tokend_pb2 as pb


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-commands")
    a = write_checkpoint(root / "A", LLAMA_GQA, seed=1)
    b = write_checkpoint(root / "B", LLAMA_GQA, seed=2)
    broken = write_checkpoint(root / "broken", LLAMA_GQA, seed=3)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return a, b, broken


def _generation(daemon: Daemon) -> str:
    request = pb.GenerateRequest(model="m", prompt="hi", sampling=pb.SamplingParams(max_tokens=2))
    return list(daemon.generation.Generate(request, timeout=60))[-1].generation


def _settle(daemon: Daemon, timeout: float = 120) -> pb.RolloutStatus:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = daemon.admin.GetRollout(pb.GetRolloutRequest(model="m")).rollouts[0]
        if status.phase in ("done", "canary", "failed"):
            return status
        time.sleep(0.2)
    raise AssertionError(f"the rollout did not settle: {status}")


def _refusal(daemon: Daemon, **fields) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        daemon.admin.Rollout(pb.RolloutRequest(**fields))
    return raised.value


def test_bad_commands_are_refused_naming_the_field(checkpoints):
    a, b, _ = checkpoints
    with Daemon("--model", str(a), "--served-model-name", "m") as daemon:  # one group, no spare device
        invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
        cases = [
            ({"model": "nope", "path": str(b)}, grpc.StatusCode.NOT_FOUND, "model:"),
            ({"model": "m", "path": "/no/such/dir"}, precondition, "model_roots:"),  # outside: not even probed
            ({"model": "m", "path": str(b.parent / "missing")}, invalid, "path:"),
            ({"model": "m", "path": "B"}, invalid, "path:"),  # relative: whose working directory?
            ({"model": "m", "path": str(b), "strategy": "sideways"}, invalid, "strategy:"),
            ({"model": "m", "path": str(b), "canary_percent": 150}, invalid, "canary_percent:"),
            ({"model": "m", "rollback": True}, precondition, "rollback:"),
            ({"model": "m", "path": str(b), "strategy": "surge"}, precondition, "strategy:"),
            ({"model": "m", "path": str(b), "canary_percent": 50}, precondition, "canary_percent:"),
        ]  # fmt: skip
        for fields, code, field in cases:
            error = _refusal(daemon, **fields)
            assert (error.code(), error.details().split(" ")[0]) == (code, field), fields
        status = daemon.admin.GetRollout(pb.GetRolloutRequest(model="m")).rollouts[0]
        assert status.phase == "none" and status.epoch == 0  # nothing refused changed anything


@pytest.fixture(scope="module")
def with_spare(checkpoints):
    """A daemon on A with a spare group, shared by the next two tests: each starts and ends on A, epoch 0 (the
    first rolls back to it, the second's rollout fails back to it)."""
    a, _, _ = checkpoints
    with Daemon("--model", str(a), "--served-model-name", "m", "--spare-devices", "cpu") as daemon:
        yield daemon


def test_canary_splits_new_requests_until_lifted_then_rollback_returns_to_the_old_weights(checkpoints, with_spare):
    a, b, _ = checkpoints
    daemon = with_spare
    generation_a = _generation(daemon)
    daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(b), canary_percent=50))
    status = _settle(daemon)
    assert (status.phase, status.canary_percent) == ("canary", 50)
    assert sorted(w.state for w in status.workers) == ["serving", "serving"]  # the old weights still serve
    seen = {_generation(daemon) for _ in range(24)}
    generation_b = (seen - {generation_a}).pop()
    assert seen == {generation_a, generation_b}  # both sides of the split answer (1 in 2**23 to fail by luck)

    daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(b)))  # the same weights, no canary: finish
    status = _settle(daemon)
    assert status.phase == "done"
    assert {_generation(daemon) for _ in range(6)} == {generation_b}
    assert [e["worker"] for e in daemon.log_entries("worker_retired")] == ["m/0"]

    # The command line, as an operator types it: back to A, waiting until it is done.
    # No key given: the CLI sends the local admin token from the daemon's state directory.
    command = [sys.executable, "-m", "daemon.cli", "rollout", "--address", daemon.address, "--model", "m",
               "--rollback", "--state-dir", daemon.state_dir]  # fmt: skip
    finished = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert "m: done (epoch 0" in finished.stdout and "rollback_started" in finished.stdout
    assert {_generation(daemon) for _ in range(6)} == {generation_a}


def test_weights_that_cannot_serve_fail_the_rollout_and_the_old_ones_keep_serving(checkpoints, with_spare):
    a, _, broken = checkpoints
    daemon = with_spare
    before = daemon.admin.GetRollout(pb.GetRolloutRequest(model="m")).rollouts[0]
    assert before.phase in ("none", "done") and before.epoch == 0  # on A, whatever ran on it before
    generation_a = _generation(daemon)
    daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(broken)))
    status = _settle(daemon)
    assert status.phase == "failed" and "exited with 78" in status.error
    assert (status.epoch, status.path) == (0, str(a))  # back on the weights it came from
    assert _generation(daemon) == generation_a
    assert daemon.health_status() == health_pb2.HealthCheckResponse.SERVING
    assert daemon.process.poll() is None  # the daemon itself never gave up
