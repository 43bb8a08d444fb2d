"""The Grafana dashboard's panels, written once: each query is PromQL (deploy/grafana/tokend-dashboard.json is made
from it) and the same computation over two scrapes of /metrics (scripts/render_dashboard.py draws the panels so).

    .venv/bin/python scripts/dashboard_panels.py > deploy/grafana/tokend-dashboard.json

A test checks that the JSON is still this script's output, and that its queries name only metrics a daemon exports.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

RATE_WINDOW = "$__rate_interval"  # Grafana's: at least four scrape intervals
MODEL_FILTER = 'model_name=~"$model_name"'

# A scrape: sample name -> [(its labels, its value)]
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True)
class Window:
    """Two scrapes `seconds` apart: what a range vector over [before, now] holds, for rate() and increase()."""

    before: Samples
    now: Samples
    seconds: float

    def increases(self, name: str) -> list[tuple[dict[str, str], float]]:
        earlier = {_key(labels): value for labels, value in self.before.get(name, [])}
        out = []
        for labels, value in self.now.get(name, []):
            start = earlier.get(_key(labels), 0.0)
            out.append((labels, value - start if value >= start else value))  # a smaller value: the counter reset
        return out


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


def _selector(model_scoped: bool) -> str:
    return "{" + MODEL_FILTER + "}" if model_scoped else ""


def _by(labels: tuple[str, ...]) -> str:
    return f" by ({', '.join(labels)}) " if labels else ""


def _legend(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


def _grouped(series: list[tuple[dict[str, str], float]], by: tuple[str, ...], reduce) -> dict[tuple, float]:
    groups: dict[tuple, list[float]] = {}
    for labels, value in series:
        groups.setdefault(tuple((name, labels.get(name, "")) for name in by), []).append(value)
    return {group: reduce(values) for group, values in groups.items()}


@dataclass(frozen=True)
class Quantile:
    """histogram_quantile over the window's bucket increases, all series summed."""

    histogram: str
    q: float
    model_scoped: bool = True

    @property
    def legend(self) -> str:
        return f"p{round(self.q * 100)}"

    @property
    def promql(self) -> str:
        buckets = f"rate({self.histogram}_bucket{_selector(self.model_scoped)}[{RATE_WINDOW}])"
        return f"histogram_quantile({self.q}, sum by (le) ({buckets}))"

    def evaluate(self, window: Window) -> dict[str, float]:
        per_bound = _grouped(window.increases(f"{self.histogram}_bucket"), ("le",), sum)
        cumulative = sorted((float(dict(group)["le"]), count) for group, count in per_bound.items())
        value = histogram_quantile(self.q, cumulative)
        return {} if value is None else {self.legend: value}


@dataclass(frozen=True)
class MeanOf:
    """The mean observation in the window: rate of the histogram's sum over rate of its count."""

    histogram: str
    legend: str
    model_scoped: bool = True

    @property
    def promql(self) -> str:
        selector = _selector(self.model_scoped)
        return (
            f"sum(rate({self.histogram}_sum{selector}[{RATE_WINDOW}]))"
            f" / sum(rate({self.histogram}_count{selector}[{RATE_WINDOW}]))"
        )

    def evaluate(self, window: Window) -> dict[str, float]:
        count = sum(value for _, value in window.increases(f"{self.histogram}_count"))
        if not count:
            return {}
        return {self.legend: sum(value for _, value in window.increases(f"{self.histogram}_sum")) / count}


@dataclass(frozen=True)
class Rate:
    """Per-second rate of a counter, summed (by some labels: one line per value)."""

    counter: str  # its sample name, with _total
    legend: str
    by: tuple[str, ...] = ()
    model_scoped: bool = True

    @property
    def promql(self) -> str:
        return f"sum{_by(self.by)}(rate({self.counter}{_selector(self.model_scoped)}[{RATE_WINDOW}]))"

    def evaluate(self, window: Window) -> dict[str, float]:
        groups = _grouped(window.increases(self.counter), self.by, sum)
        return {_legend(self.legend, dict(group)): value / window.seconds for group, value in groups.items()}


@dataclass(frozen=True)
class Ratio:
    """One counter's rate over another's (a hit rate)."""

    numerator: str
    denominator: str
    legend: str
    model_scoped: bool = True

    @property
    def promql(self) -> str:
        selector = _selector(self.model_scoped)
        return (
            f"sum(rate({self.numerator}{selector}[{RATE_WINDOW}]))"
            f" / sum(rate({self.denominator}{selector}[{RATE_WINDOW}]))"
        )

    def evaluate(self, window: Window) -> dict[str, float]:
        denominator = sum(value for _, value in window.increases(self.denominator))
        if not denominator:
            return {}
        return {self.legend: sum(value for _, value in window.increases(self.numerator)) / denominator}


@dataclass(frozen=True)
class Level:
    """A gauge's latest value, summed or maxed (by some labels: one line per value)."""

    gauge: str
    legend: str
    aggregate: str = "sum"  # or "max"
    by: tuple[str, ...] = ()
    model_scoped: bool = True

    @property
    def promql(self) -> str:
        return f"{self.aggregate}{_by(self.by)}({self.gauge}{_selector(self.model_scoped)})"

    def evaluate(self, window: Window) -> dict[str, float]:
        groups = _grouped(window.now.get(self.gauge, []), self.by, {"sum": sum, "max": max}[self.aggregate])
        return {_legend(self.legend, dict(group)): value for group, value in groups.items()}


Query = Quantile | MeanOf | Rate | Ratio | Level


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana's unit id: s, reqps, percentunit, short
    description: str
    queries: tuple[Query, ...]


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile: `cumulative` is [(upper bound, count up to it)], +Inf last; linear
    interpolation inside the bucket the rank falls in; the +Inf bucket answers the highest finite bound."""
    if not cumulative or not math.isinf(cumulative[-1][0]) or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    for index, (upper, count) in enumerate(cumulative):
        if count >= rank:
            if math.isinf(upper):
                return cumulative[index - 1][0] if index else None
            lower, below = cumulative[index - 1] if index else (0.0, 0.0)
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
    return None


def _quantiles(histogram: str, model_scoped: bool = True) -> tuple[Query, ...]:
    return (Quantile(histogram, 0.5, model_scoped), Quantile(histogram, 0.99, model_scoped))


PANELS = (
    Panel(
        "Requests finished / s",
        "reqps",
        "Requests that ended, by finish reason (stop, length, abort)",
        (Rate("tokend:request_success_total", "{{finished_reason}}", by=("finished_reason",)),),
    ),
    Panel(
        "Time to first token",
        "s",
        "Arrival at the frontend to the first streamed token",
        _quantiles("tokend:time_to_first_token_seconds"),
    ),
    Panel("Inter-token latency", "s", "Time between streamed tokens", _quantiles("tokend:inter_token_latency_seconds")),
    Panel("End-to-end latency", "s", "Arrival to the last token", _quantiles("tokend:e2e_request_latency_seconds")),
    Panel(
        "Request phases (mean)",
        "s",
        "Queue: in admission and in the scheduler's queue; prefill: first scheduled step to first token; decode: "
        "first token to last",
        (
            MeanOf("tokend:request_queue_time_seconds", "queue"),
            MeanOf("tokend:request_prefill_time_seconds", "prefill"),
            MeanOf("tokend:request_decode_time_seconds", "decode"),
        ),
    ),
    Panel(
        "Requests running / waiting",
        "short",
        "In the schedulers' running batches, in their queues, and waiting in the frontend's admission",
        (
            Level("tokend:num_requests_running", "running"),
            Level("tokend:num_requests_waiting", "waiting (scheduler)"),
            Level("tokend:admission_queue_depth", "waiting (admission)", model_scoped=False),
        ),
    ),
    Panel(
        "KV cache usage",
        "percentunit",
        "Share of each scheduler's KV cache pages held by live sequences",
        (Level("tokend:kv_cache_usage_perc", "{{model_name}}/{{group}}", "max", by=("model_name", "group")),),
    ),
    Panel(
        "Projected time to first token",
        "s",
        "Each scheduler's worst projection for a waiting request: what routing and admission act on",
        (Level("tokend:projected_ttft_seconds", "{{model_name}}/{{group}}", "max", by=("model_name", "group")),),
    ),
    Panel(
        "Prefix cache hit rate",
        "percentunit",
        "Prompt tokens found in the prefix cache, of those looked up",
        (Ratio("tokend:prefix_cache_hits_total", "tokend:prefix_cache_queries_total", "hit rate"),),
    ),
    Panel(
        "Tokens / s",
        "short",
        "Prompt and generated tokens, counted as each request ends",
        (
            Rate("tokend:prompt_tokens_total", "prompt"),
            Rate("tokend:generation_tokens_total", "generation"),
        ),
    ),
    Panel(
        "Shed requests / s",
        "reqps",
        "Requests refused or dropped under pressure, by class and reason",
        (
            Rate(
                "tokend:admission_shed_total", "{{priority}} {{reason}}", by=("priority", "reason"), model_scoped=False
            ),
        ),
    ),
    Panel(
        "Tokens per engine step",
        "short",
        "Prompt chunks plus decodes each scheduler step computed: how full the batches are",
        _quantiles("tokend:iteration_tokens_total"),
    ),
)

_DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_COLUMNS = 3


def dashboard() -> dict:
    """The Grafana dashboard (schema 39): a data source and a model variable, and PANELS in rows of three."""
    width = 24 // _COLUMNS
    panels = [
        {
            "id": index + 1,
            "type": "timeseries",
            "title": panel.title,
            "description": panel.description,
            "datasource": _DATASOURCE,
            "gridPos": {"h": 8, "w": width, "x": (index % _COLUMNS) * width, "y": (index // _COLUMNS) * 8},
            "fieldConfig": {
                "defaults": {
                    "unit": panel.unit,
                    "min": 0,
                    "custom": {"drawStyle": "line", "lineWidth": 2, "fillOpacity": 10, "showPoints": "never"},
                },
                "overrides": [],
            },
            "options": {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"},
            },
            "targets": [
                {
                    "refId": chr(ord("A") + number),
                    "datasource": _DATASOURCE,
                    "expr": query.promql,
                    "legendFormat": query.legend,
                }
                for number, query in enumerate(panel.queries)
            ],
        }
        for index, panel in enumerate(PANELS)
    ]
    models = "label_values(tokend:num_requests_running, model_name)"
    return {
        "title": "tokend",
        "uid": "tokend-serving",
        "description": "tokend's serving metrics (vLLM's names with a tokend: prefix); see deploy/grafana/README.md",
        "tags": ["tokend", "llm", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "",
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "options": [],
                    "regex": "",
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": _DATASOURCE,
                    "definition": models,
                    "query": {"query": models, "refId": "models"},
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                    "hide": 0,
                    "refresh": 2,
                    "sort": 1,
                    "options": [],
                    "regex": "",
                },
            ]
        },
        "panels": panels,
    }


def dashboard_text() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    print(dashboard_text(), end="")
