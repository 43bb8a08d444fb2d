"""The daemon's JSON log: errors as they appear (to tie them to the input just sent), and a summary after the run
(errors by process and exception, dropped IPC messages, restarts)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

_MAX_KINDS = 15


def summarize(log_path: Path) -> dict:
    errors: Counter = Counter()
    first_seen: dict[str, str] = {}
    events: Counter = Counter()
    try:
        text = log_path.read_text(errors="replace")
    except OSError as error:
        return {"unreadable": str(error)}
    for line in text.splitlines():
        entry = _parse(line)
        if entry is None:
            continue
        event = str(entry.get("event", "")).strip()
        if event in (
            "dropped_bad_message",
            "child_exited",
            "restarting",
            "scheduler_stalled",
            "scheduler_lost",
            "usage_interrupted",
        ):
            events[f"{entry.get('process', '?')}: {event}"] += 1
        if entry.get("level") in ("error", "critical") or "exception" in entry:
            signature = _signature(entry, event)
            errors[signature] += 1
            first_seen.setdefault(signature, str(entry.get("timestamp", "")))
    top = {kind: {"count": count, "first_at": first_seen[kind]} for kind, count in errors.most_common(_MAX_KINDS)}
    if len(errors) > _MAX_KINDS:
        top["(other kinds)"] = {"count": sum(errors.values()) - sum(e["count"] for e in top.values())}
    return {"errors": top, "events": dict(events.most_common())}


class LogTail:
    """Reads what the log gained since the last call: the signatures of new error records."""

    def __init__(self, log_path: Path):
        self.path = log_path
        self.offset = log_path.stat().st_size if log_path.exists() else 0

    def new_errors(self) -> list[str]:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a record still being written waits for the next call
        self.offset += len(complete)
        signatures = []
        for line in complete.decode(errors="replace").splitlines():
            entry = _parse(line)
            if entry is not None and (entry.get("level") in ("error", "critical") or "exception" in entry):
                signatures.append(_signature(entry, str(entry.get("event", "")).strip()))
        return signatures


def _parse(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None


def _signature(entry: dict, event: str) -> str:
    """process: event | the exception's last line (its type and message), so that one bug reads as one line."""
    exception = str(entry.get("exception", "")).strip().splitlines()
    last = exception[-1][:160] if exception else ""
    return f"{entry.get('process', '?')}: {event.splitlines()[0][:100] if event else '?'}" + (
        f" | {last}" if last else ""
    )
