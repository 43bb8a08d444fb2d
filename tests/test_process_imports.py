"""Imports point down the process map: the frontend, gateway and supervisor never load torch, and none of the
three process packages reaches into another's internals."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_IMPORT_ALL = """
import importlib, pkgutil, sys
import frontend
modules = [m.name for m in pkgutil.walk_packages(frontend.__path__, "frontend.")]
modules += ["gpu_runtime.ipc.messages", "gpu_runtime.tokenizer", "daemon.cli", "daemon.config", "daemon.supervisor",
            "daemon.serve_command"]
for name in modules:
    importlib.import_module(name)
print(len(modules), sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_frontend_gateway_and_supervisor_modules_import_without_torch():
    """Every module the frontend and gateway processes (and `tokend serve` itself) may import, imported in a fresh
    interpreter: torch must not come with any of them."""
    result = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    count, loaded = result.stdout.split(" ", 1)
    assert int(count) > 20, "the walk found the frontend's modules"
    assert loaded.strip() == "[]", f"torch was imported: {loaded}"


@pytest.mark.parametrize("package", ["frontend", "gpu_runtime"])
def test_process_packages_do_not_import_the_daemon(package):
    """What every process shares (logs, exit codes, child setup) lives in common/, below the three packages."""
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names if n == "daemon" or n.startswith("daemon.")]
    assert offenders == []


_START_ENGINE = """
import sys
from gpu_runtime.engine import LLMEngine
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
LLMEngine(EngineConfig(model=TINY_RANDOM_MODEL_NAME, device="cpu"))
print(sorted(m for m in ("torch._dynamo", "sympy", "gguf") if m in sys.modules))
"""


def test_a_scheduler_builds_its_engine_without_the_slow_optional_imports():
    """Every scheduler start (every daemon's, rollout's and autoscaled worker's) builds an engine: building it must
    not pull in torch._dynamo or sympy (1.5 s together, which torch's Python references of normal_ and empty_like
    on the meta device once did) or, for a checkpoint without GGUF blocks, the gguf package (up to 0.5 s)."""
    command = [sys.executable, "-c", _START_ENGINE]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
