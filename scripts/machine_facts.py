"""What a benchmark report says about where it ran: the machine, the software, the commit."""

from __future__ import annotations

import datetime
import math
import os
import platform
import subprocess
from pathlib import Path

import torch
from safetensors import safe_open


def machine_facts() -> dict:
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def parameter_count(model_dir: Path) -> int:
    """Parameters in a checkpoint directory's safetensors files, read from their headers only."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as checkpoint:
            for name in checkpoint.keys():  # noqa: SIM118 (safe_open has keys() but no __iter__)
                total += math.prod(checkpoint.get_slice(name).get_shape())
    return total


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """The short commit, with "-dirty" when tracked files differ from it; None outside a git checkout."""
    commit = _git("rev-parse", "--short", "HEAD")
    if not commit:
        return None
    return f"{commit}-dirty" if _git("status", "--porcelain", "--untracked-files=no") else commit


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parents[1])
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip()
