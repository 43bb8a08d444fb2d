"""The metric names a Grafana dashboard's queries use, and the names a daemon's /metrics text lets them use."""

from __future__ import annotations

import promql_parser
from exposition import family_types

# Grafana's variables, as a query is sent: any valid value will do for parsing.
_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*"}
# The sample names each family type exposes (a family with labels but no series yet still has its # TYPE line).
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count")}


def dashboard_queries(dashboard: dict) -> list[str]:
    """The expression of every target of every panel (rows' nested panels included)."""
    queries, panels = [], list(dashboard.get("panels", []))
    while panels:
        panel = panels.pop(0)
        panels.extend(panel.get("panels", []))
        queries.extend(target["expr"] for target in panel.get("targets", []))
    return queries


def metric_names(query: str) -> set[str]:
    """The metrics a PromQL query selects; raises ValueError if it is not valid PromQL."""
    for variable, value in _VARIABLES.items():
        query = query.replace(variable, value)
    names: set[str] = set()

    def visit(node) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.add(node.name)

    promql_parser.walk(promql_parser.parse(query), pre_visit=visit)
    return names


def exported_metric_names(text: str) -> set[str]:
    names = set()
    for name, kind in family_types(text).items():
        if kind == "counter":  # the text format names a counter's family with its _total already
            name = name.removesuffix("_total")
        names.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names
