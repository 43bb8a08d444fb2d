"""Report: what the chaos run tried, what came back per surface, and what was lost, as one JSON object."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

# Every kind of loss; the run is ok iff each count is zero.
LOSS_KINDS = (
    "five_xx",  # an HTTP 5xx (in the fuzz phase any; under faults any but a 503, the documented "retry")
    "hung",  # no answer within the deadline
    "cut_streams",  # a stream that ended without a finish reason and without an error status or event
    "ledger_missing",  # a request the client saw served has no ledger row
    "ledger_wrong",  # a row with the wrong status or counts, left running, or billed to the wrong tenant
    "grpc_internal",  # gRPC INTERNAL or UNKNOWN: an exception escaped somewhere
    "bad_answers",  # an answer that is neither a success nor a documented error (e.g. a 200 without a body)
    "canary_failed",  # a real request failed while fuzzing: the daemon stopped serving others
    "not_recovered",  # the daemon did not serve again within the bound after a fault
    "not_refused",  # a hardened surface took what it must refuse (a forged pull, a rollout off the roots, ...)
)
MAX_EXAMPLES = 5
MAX_KINDS = 12


@dataclass(slots=True)
class Outcome:
    """One input's result: a histogram label, the loss kind it counts as (None: fine), and what was seen."""

    label: str
    loss: str | None = None
    detail: str = ""


@dataclass(slots=True)
class LossBucket:
    count: int = 0
    examples: list[dict] = field(default_factory=list)
    kinds: Counter = field(default_factory=Counter)  # signature -> count, so one bug does not hide another

    def add(self, example: dict, signature: str) -> None:
        self.count += 1
        new_kind = signature not in self.kinds
        if new_kind and len(self.kinds) >= MAX_KINDS:
            signature = "(other)"
        self.kinds[signature] += 1
        if new_kind and len(self.examples) >= MAX_EXAMPLES:
            # A new kind of failure replaces an example of a kind already shown twice, if there is one.
            shown = Counter(e["kind"] for e in self.examples)
            repeat = next((i for i, e in enumerate(self.examples) if shown[e["kind"]] > 1), None)
            if repeat is not None:
                self.examples[repeat] = {**example, "kind": signature}
        elif len(self.examples) < MAX_EXAMPLES:
            self.examples.append({**example, "kind": signature})

    def to_json(self) -> dict:
        return {"count": self.count, "examples": self.examples, "kinds": dict(self.kinds.most_common())}


class Report:
    """Thread-safe: the load threads and the fault loop record into it at once."""

    def __init__(self, config: dict):
        self.config = config
        self.inputs_tried: Counter = Counter()
        self.inputs_skipped: Counter = Counter()
        self.outcomes: dict[str, Counter] = {}
        self.lost = {kind: LossBucket() for kind in LOSS_KINDS}
        self.faults_injected: list[dict] = []
        self.recoveries: list[dict] = []
        self.notes: dict[str, object] = {}
        self.durations_s: dict[str, float] = {}
        self.logged_errors: dict[str, dict] = {}  # signature -> count and the inputs just before it was logged
        self.losses_by_surface: Counter = Counter()
        self.hardened: dict[str, dict] = {}  # surface -> inputs sent, refused as expected, incidents (hardened_audit)
        self._lock = threading.Lock()

    def record(self, surface: str, outcome: Outcome, shown_input: str = "") -> None:
        with self._lock:
            self.inputs_tried[surface] += 1
            self.outcomes.setdefault(surface, Counter())[outcome.label] += 1
        if outcome.loss is not None:
            self.lose(outcome.loss, surface, outcome.label, outcome.detail, shown_input)

    def count(self, surface: str, label: str) -> None:
        """An outcome of background work (load, canaries) that is not a fuzz input."""
        with self._lock:
            self.outcomes.setdefault(surface, Counter())[label] += 1

    def skip(self, surface: str, count: int = 1) -> None:
        with self._lock:
            self.inputs_skipped[surface] += count

    def lose(
        self, kind: str, surface: str, label: str, detail: str, shown_input: str = "", signature: str | None = None
    ) -> None:
        """One loss; its signature (default: surface, label and the detail's start) groups it with its kind."""
        example = {"surface": surface, "outcome": label, "detail": detail[:400]}
        if shown_input:
            example["input"] = shown_input[:400]
        signature = signature or f"{surface} {label} {_first_line(detail)[:80]}".strip()
        with self._lock:
            self.lost[kind].add(example, signature)
            self.losses_by_surface[surface] += 1

    def note_harness_error(self, text: str) -> None:
        """A failure of this script itself (not of the daemon): counted, the first few shown."""
        with self._lock:
            self.notes["harness_errors"] = self.notes.get("harness_errors", 0) + 1
            shown = self.notes.setdefault("harness_error_examples", [])
            if len(shown) < MAX_EXAMPLES:
                shown.append(text[-800:])

    def note_logged_error(self, signature: str, surface: str, inputs: list[str]) -> None:
        """An error the daemon logged while fuzzing, with the inputs sent just before (the last is the likeliest)."""
        with self._lock:
            seen = self.logged_errors.setdefault(signature, {"count": 0, "surface": surface, "inputs_before": []})
            seen["count"] += 1
            if len(seen["inputs_before"]) < 3:
                seen["inputs_before"].append(inputs)

    @property
    def ok(self) -> bool:
        return all(bucket.count == 0 for bucket in self.lost.values())

    def to_json(self) -> dict:
        return {
            "ok": self.ok,
            "config": self.config,
            "durations_s": {k: round(v, 1) for k, v in self.durations_s.items()},
            "inputs_tried": dict(self.inputs_tried),
            "inputs_tried_total": sum(self.inputs_tried.values()),
            "inputs_skipped": dict(self.inputs_skipped),
            "outcomes": {surface: dict(counter.most_common()) for surface, counter in self.outcomes.items()},
            "faults_injected": self.faults_injected,
            "recoveries": self.recoveries,
            "hardened_surfaces": self.hardened,
            "lost": {kind: bucket.to_json() for kind, bucket in self.lost.items()},
            "daemon_errors_while_fuzzing": dict(sorted(self.logged_errors.items(), key=lambda kv: -kv[1]["count"])),
            "notes": self.notes,
        }


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""
