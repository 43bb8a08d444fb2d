"""After the daemon stops (its log final): per hardened surface, the inputs sent, those refused as expected (by the
answer, or for the answerless control channel by its refusal log lines) and the incidents; a control message sent
but never logged as refused is an incident too, unless a recovery on that surface may have lost it."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from chaos.report import Report

HARDENED = ("rollout_paths", "gguf_files", "kv_socket", "control_channel")
# The refusals each surface's inputs leave in the log. Not replayed_message: a forged MAC never gets that far, and
# the faults' restarts make genuine replays of their own.
_LOGGED = {
    "kv_socket": ("kv_pull_refused", "kv_pull_dropped"),
    "control_channel": ("forged_message", "dropped_bad_message"),
}


def _log_events(log_path: Path, end: int | None) -> Counter:
    """Events in the log's first `end` bytes (None: all of it), `event@channel` for those that name a channel."""
    events: Counter = Counter()
    try:
        with log_path.open("rb") as file:
            lines = file.read(end if end is not None else -1).decode(errors="replace").splitlines()
    except OSError:
        return events
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            channel = entry.get("channel")
            events[f"{entry.get('event')}@{channel}" if channel else str(entry.get("event"))] += 1
    return events


def audit_hardened(report: Report, log_path: Path, fuzz_log_end: int | None) -> None:
    """Fills report.hardened; the log is read up to the fuzz phase's end (`fuzz_log_end`, its size then)."""
    events = _log_events(log_path, fuzz_log_end)
    recovered_on = {recovery["surface"] for recovery in report.recoveries}
    for surface in HARDENED:
        if surface not in report.outcomes and surface not in report.inputs_skipped:
            continue
        outcomes = report.outcomes.get(surface, Counter())
        sent = sum(count for label, count in outcomes.items() if not label.startswith("not sent"))
        logged = {event: events[f"{event}@control" if surface == "control_channel" else event]
                  for event in _LOGGED.get(surface, ())}  # fmt: skip
        if surface == "control_channel":
            refused = sum(logged.values())
            if refused < sent and surface not in recovered_on:
                report.lose("not_refused", surface, "not logged as refused",
                            f"{sent} sent, {refused} logged as refused: the rest taken or lost")  # fmt: skip
        else:
            refused = sum(count for label, count in outcomes.items() if label.startswith(("refused", "junk sent")))
        report.hardened[surface] = {
            "inputs_sent": sent,
            "refused_as_expected": refused,
            **_read_as_expected(surface, outcomes),
            "incidents": report.losses_by_surface[surface],
            "skipped": report.inputs_skipped[surface],
            "outcomes": dict(outcomes.most_common()),
            **({"refusal_log_lines": logged} if logged else {}),
        }


def _read_as_expected(surface: str, outcomes: Counter) -> dict:
    """GGUF header flips that left the file well-formed, read as they should be."""
    return {"read_as_expected": outcomes["read (a flip that left it well-formed)"]} if surface == "gguf_files" else {}
