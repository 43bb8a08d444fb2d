"""The GPU check's runner: one JSON line per section on stdout (progress on stderr), in under 8 minutes on one H200.

Its command line is scripts/gpu_check.py, run through scripts/gpu_check.sh (the machine's own Python and torch).
On CUDA the sections run in a few processes (CUDA_PROCESSES), each with its time limit, so that one that fails,
hangs or leaves the device in an error state costs its own lines ({"section": ..., "ok": false, "error": ...}) and
nothing else; an exception costs only its section's line. The dry run runs them all in one process.
The sections are in gpu/sections.py; a last line sums them up. Exit status: 0 when every section
is ok (or skipped), 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from traceback import format_exc

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"  # what a section's process runs
WORK_DIR_VARIABLE = "TOKEND_GPU_CHECK_WORK_DIR"  # the run's temporary directory, for its sections' checkpoints
# Seconds each section may take on an H200 (the dry run takes far less); together well inside 8 minutes, and the
# whole run stops starting sections once its budget is spent.
SECTION_LIMITS_S = {
    "environment": 60,
    "exactness_fp32": 90,
    "agreement_bf16": 60,
    "cached_and_chunked": 60,
    "seeds": 60,
    "decode": 240,
    "loader_memory": 120,
    "large_pool": 90,
    "sampler": 60,
    "two_schedulers": 60,
    "tensor_parallel": 120,
    "gpu_tests": 180,
}
BUDGET_S = 460
# The sections that share a process on CUDA (a device error, a hang or a leak stays inside its process); fewer
# processes start CUDA fewer times. The dry run runs them all in one.
CUDA_PROCESSES = [
    ["environment"],
    ["exactness_fp32", "agreement_bf16", "cached_and_chunked", "seeds"],
    ["decode"],
    ["loader_memory"],
    ["large_pool"],
    ["sampler", "two_schedulers"],
    ["tensor_parallel"],
    ["gpu_tests"],
]
DRY_RUN_SLOWDOWN = 3  # the dry run's limits: a shared CPU runs the small sections slower than an H200 the big ones


def main() -> int:
    args = _parse_args()
    if args.child:  # a child: run its sections, one line each
        return _run_sections(args.child.split(","), args.dry_run)
    names = args.sections.split(",") if args.sections else list(SECTION_LIMITS_S)
    unknown = sorted(set(names) - set(SECTION_LIMITS_S))
    if unknown:
        print(f"--sections: unknown {unknown}; known: {','.join(SECTION_LIMITS_S)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tokend-gpu-check-") as work_dir:
        os.environ[WORK_DIR_VARIABLE] = work_dir  # the sections' checkpoints: removed here, whatever they did
        lines = _run_groups(names, args.dry_run)
    ok = all(line.get("ok") is not False for line in lines)
    summary = {"section": "summary", "ok": ok, "dry_run": args.dry_run, "seconds": round(time.monotonic() - started)}
    summary["sections"] = {line["section"]: line.get("ok", "skipped" in line) for line in lines}
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def _run_groups(names: list[str], dry_run: bool) -> list[dict]:
    """Every section's line, printed as it comes, in CUDA_PROCESSES' processes (the dry run's in one: a CPU keeps
    no device state, and each process would pay for importing torch and transformers again). Without CUDA (and not
    a dry run) only the environment is reported."""
    budget_s, slowdown = (BUDGET_S * DRY_RUN_SLOWDOWN, DRY_RUN_SLOWDOWN) if dry_run else (BUDGET_S, 1)
    groups = [names] if dry_run else [[n for n in group if n in names] for group in CUDA_PROCESSES]
    started = time.monotonic()
    lines: list[dict] = []
    no_cuda = None
    for group in filter(None, groups):
        left = budget_s - (time.monotonic() - started)
        if no_cuda:
            results = [{"section": name, "ok": False, "skipped": no_cuda} for name in group]
        elif left < 10:
            results = [{"section": name, "ok": False, "skipped": f"the {budget_s} s budget is spent"} for name in group]
        else:
            results = _child(group, dry_run, min(sum(SECTION_LIMITS_S[n] for n in group) * slowdown, left))
        for line in results:
            if line["section"] == "environment" and not dry_run and line.get("cuda_available") is False:
                no_cuda = "no CUDA device here: run with --dry-run"
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


def _child(group: list[str], dry_run: bool, limit_s: float) -> Iterator[dict]:
    """Runs `group`'s sections in a fresh process, yielding each one's line as it comes (its other output goes to
    stderr), then an error line for each section it did not report: killed at `limit_s`, or it died."""
    command = [sys.executable, str(SCRIPT), "--child", ",".join(group)] + (["--dry-run"] if dry_run else [])
    print(f"gpu_check: {','.join(group)} (limit {limit_s:.0f} s)", file=sys.stderr, flush=True)
    # A session of its own, so that a kill takes its children too (the benchmark's, pytest's), which would else
    # hold the device through the sections that follow.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, start_new_session=True)
    killed = threading.Event()
    timer = threading.Timer(limit_s, lambda: (killed.set(), os.killpg(process.pid, signal.SIGKILL)))
    timer.start()
    reported = set()
    try:
        for text in process.stdout:
            line = _json_line(text)
            if line is not None and line.get("section") in group:
                reported.add(line["section"])
                yield line
            else:
                sys.stderr.write(text)
        process.wait()
    finally:
        timer.cancel()
    for name in group:
        if name not in reported:
            error = (
                f"timed out after {limit_s:.0f} s" if killed.is_set() else f"its process exited {process.returncode}"
            )
            yield {"section": name, "ok": False, "error": f"{error} before reporting (its output: stderr)"}


def _json_line(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _run_sections(names: list[str], dry_run: bool) -> int:
    """In the child: each section's fields, or its error, as one JSON line, as soon as it is done."""
    import torch

    from gpu.sections import SECTIONS

    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda"
    for name in names:
        started = time.monotonic()
        try:
            result = SECTIONS[name](device, dry_run)
        except Exception as error:  # noqa: BLE001 - the point is to report any failure as this section's line
            result = {
                "ok": False,
                "error": f"{type(error).__name__}: {error}"[:2000],
                "traceback": format_exc()[-2000:],
            }
        line = {"section": name, **result, "seconds": round(time.monotonic() - started, 1)}
        if "ok" not in line and "skipped" not in line:
            line["ok"] = True
        print(json.dumps(line, default=str), flush=True)
    return 0


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU, tiny shapes")
    parser.add_argument("--sections", default="", help=f"comma-separated subset of {','.join(SECTION_LIMITS_S)}")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)  # a child process's sections
    return parser.parse_args()
