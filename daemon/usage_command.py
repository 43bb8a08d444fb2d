"""`tokend usage`: token usage per tenant, read from the usage ledger (never while holding a write lock)."""

from __future__ import annotations

import argparse
import contextlib
import json
from datetime import datetime
from pathlib import Path

from frontend.usage_ledger import LEDGER_FILE, connect, summarize


def run_usage(args: argparse.Namespace) -> int:
    path = Path(args.state_dir) / LEDGER_FILE
    if not path.is_file():
        raise ValueError(f"state_dir: no usage ledger at {path}")
    with contextlib.closing(connect(path, read_only=True)) as connection:
        tenants = summarize(connection, _since(args.since))
    if args.json:
        print(json.dumps({"tenants": tenants}, indent=2))
        return 0
    print(f"{'tenant':<24}{'requests':>10}{'prompt':>12}{'completion':>12}{'cached':>10}{'cancelled':>11}")
    for name, usage in tenants.items():
        print(
            f"{name or '(no auth)':<24}{usage['requests']:>10}{usage['prompt_tokens']:>12}"
            f"{usage['completion_tokens']:>12}{usage['cached_tokens']:>10}{usage['cancelled']:>11}"
        )
    return 0


def _since(value: str | None) -> float:
    if value is None:
        return 0.0
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise ValueError(f"since: {value!r} is neither unix seconds nor an ISO time") from None
