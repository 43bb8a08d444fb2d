"""`scripts/chaos.py`: flags, the three phases (fuzz, faults under load, audit) against one daemon, the JSON out."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

from chaos import daemon_log, processes
from chaos.canary import Canary
from chaos.daemon_setup import chaos_daemon, ledger_rows, make_tenants, stop_daemon
from chaos.faults import inject_faults
from chaos.fuzz_run import FuzzSession
from chaos.hardened_audit import audit_hardened
from chaos.ledger_audit import audit_ledger
from chaos.load import Load
from chaos.progress import Progress
from chaos.report import Report
from chaos.stream_audit import audit_streams
from chaos.surfaces import split, surfaces


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fuzz-inputs", type=int, default=10_000, help="fuzzed inputs over all surfaces")
    parser.add_argument("--faults", type=int, default=30, help="faults injected under load")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis' and the load's seed")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--timeout-per-input", type=float, default=10.0, help="seconds an input may take to answer")
    parser.add_argument("--canary-every", type=int, default=100, help="fuzz inputs between canaries (IPC: a 4th)")
    parser.add_argument("--load-streams", type=int, default=4, help="concurrent load streams, gRPC and HTTP")
    parser.add_argument("--recovery-bound", type=float, default=90.0, help="seconds to serve again after a fault")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=1140.0,
        help="seconds for the whole run; fuzzing gets half, faults the rest (what is left is skipped)",
    )
    parser.add_argument(
        "--pd", action="store_true", help="a prefill and a decode worker, so that the KV pull socket is fuzzed too"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    config["inputs_per_surface"] = split(args.fuzz_inputs, kv=args.pd)
    report = Report(config)
    progress = Progress(args.fuzz_inputs + args.faults, enabled=not args.no_progress)
    started = time.monotonic()
    try:
        with chaos_daemon(make_tenants(args.seed), pd=args.pd) as daemon:
            report.durations_s["daemon_start"] = time.monotonic() - started
            _run(daemon, args, report, progress, started)
    except Exception:
        report.lose("not_recovered", "daemon", "the run could not go on", traceback.format_exc()[-1500:])
    finally:
        progress.close()
    report.durations_s["total"] = time.monotonic() - started
    text = json.dumps(report.to_json(), indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if report.ok else 1


def _run(daemon, args: argparse.Namespace, report: Report, progress: Progress, started: float) -> None:
    tenants = make_tenants(args.seed)
    canary = Canary(daemon.address, daemon.http_url, tenants, max(args.timeout_per_input, 10.0))
    try:
        ok, detail = canary.check()
        if not ok:
            report.lose("canary_failed", "startup", "canary failed before any fuzzing", detail)
        _fuzz(daemon, args, report, progress, canary, tenants, started + args.time_budget * 0.5)
        faults, load = _faults(daemon, args, report, progress, canary, tenants, started + args.time_budget * 0.9)
    finally:
        processes.continue_all(daemon)
        canary.close()
    progress.set_phase("stopping the daemon")
    phase = time.monotonic()
    report.notes["daemon_exit_code"] = stop_daemon(daemon)
    report.durations_s["stop"] = time.monotonic() - phase
    report.notes["daemon_log"] = daemon_log.summarize(daemon.log_path)
    audit_hardened(report, daemon.log_path, report.notes.get("fuzz_log_end_bytes"))
    rows, unreadable = ledger_rows(daemon)
    audit_streams(load.records, faults, report, "load")
    for record in canary.records:
        report.count(f"canary_{record.surface}", record.end)
    audit_ledger(load.records + canary.records, rows, unreadable, report)


def _fuzz(daemon, args, report: Report, progress: Progress, canary: Canary, tenants, deadline: float) -> None:
    phase = time.monotonic()
    report.notes["fuzz_started_at"] = _utc_now()
    session = FuzzSession(daemon, canary, report, deadline, args.recovery_bound, progress.step)
    with surfaces(daemon, tenants, args.fuzz_inputs, args.timeout_per_input, args.canary_every) as all_surfaces:
        for index, surface in enumerate(all_surfaces):
            progress.set_phase(f"fuzz {surface.name}")
            session.run(surface, args.seed * 100 + index)
    report.notes["fuzz_log_end_bytes"] = daemon.log_path.stat().st_size if daemon.log_path.exists() else None
    report.durations_s["fuzz"] = time.monotonic() - phase


def _faults(daemon, args, report: Report, progress: Progress, canary: Canary, tenants, deadline: float):
    phase = time.monotonic()
    report.notes["faults_started_at"] = _utc_now()
    progress.set_phase("faults under load")
    load = Load(daemon.address, daemon.http_url, tenants, args.load_streams, args.seed)
    load.start()
    try:
        faults = inject_faults(
            daemon, canary, report, args.faults, args.seed, deadline, args.recovery_bound, progress.step
        )
    finally:
        processes.continue_all(daemon)
        load.stop()
    report.durations_s["faults"] = time.monotonic() - phase
    report.notes["load_requests"] = len(load.records)
    return faults, load


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


if __name__ == "__main__":
    sys.exit(main())
