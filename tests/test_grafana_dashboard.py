"""deploy/grafana/: the dashboard is scripts/dashboard_panels.py's output and valid PromQL throughout, the rendered
picture's arithmetic is Prometheus's, and the relabel rules give vLLM's dashboards the names they query. (That the
dashboard names only exported metrics is checked against a real daemon in test_metrics_api_port.py.)"""

from __future__ import annotations

import json
import math
import re

import pytest
import yaml
from daemon_harness import ROOT
from dashboard_queries import dashboard_queries, exported_metric_names, metric_names
from prometheus_client import generate_latest

from frontend.metrics import FrontendMetrics
from scripts import dashboard_panels  # scripts/ is a namespace package under the repository root

DASHBOARD = ROOT / "deploy" / "grafana" / "tokend-dashboard.json"


def test_the_dashboard_json_is_the_panel_scripts_output():
    # Regenerate with: .venv/bin/python scripts/dashboard_panels.py > deploy/grafana/tokend-dashboard.json
    assert DASHBOARD.read_text() == dashboard_panels.dashboard_text()


def test_every_query_is_promql_over_tokend_metrics():
    queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    assert len(queries) == sum(len(panel.queries) for panel in dashboard_panels.PANELS) >= 12
    for query in queries:
        names = metric_names(query)  # raises if it does not parse
        assert names and all(name.startswith("tokend:") for name in names), query


def test_the_panels_ask_for_what_the_issue_lists():
    titles = " | ".join(panel.title for panel in dashboard_panels.PANELS).lower()
    for wanted in ("requests finished", "time to first token", "inter-token", "end-to-end", "phases", "running",
                   "kv cache", "projected", "prefix cache hit rate", "tokens / s", "shed"):  # fmt: skip
        assert wanted in titles, wanted


@pytest.mark.parametrize(
    ("q", "expected"),
    [
        (0.5, 1.4),  # rank 5 of 10 falls in (1, 2], which holds counts 3..8: 1 + (5 - 3) / 5
        (0.9, 3.0),  # rank 9 falls in (2, 4], which holds 8..10: 2 + 2 * (9 - 8) / 2
        (0.1, 1 / 3),  # rank 1 falls in the first bucket, from 0
    ],
)
def test_the_pictures_quantiles_interpolate_as_prometheus_does(q, expected):
    cumulative = [(1.0, 3.0), (2.0, 8.0), (4.0, 10.0), (math.inf, 10.0)]
    assert dashboard_panels.histogram_quantile(q, cumulative) == pytest.approx(expected)


def test_a_quantile_in_the_inf_bucket_is_the_highest_finite_bound():
    assert dashboard_panels.histogram_quantile(0.99, [(1.0, 1.0), (2.0, 2.0), (math.inf, 10.0)]) == 2.0
    assert dashboard_panels.histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None  # nothing observed


# What vLLM's own example dashboard (examples/observability/prometheus_grafana/grafana.json) queries, less
# vllm:request_max_num_generation_tokens (per sequence group; tokend has no groups).
VLLM_DASHBOARD_NAMES = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
}  # fmt: skip


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str]:
    """Prometheus's `replace` relabeling: the source labels' values joined by ';' must match the regex whole, and
    the target label becomes the replacement with the regex's groups filled in."""
    labels = dict(labels)
    for rule in rules:
        value = ";".join(labels.get(name, "") for name in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return labels


def test_the_relabel_rules_give_vllms_dashboards_the_names_they_query():
    metrics = FrontendMetrics()
    scrape = generate_latest(metrics.registry).decode()
    (job,) = yaml.safe_load((ROOT / "deploy" / "grafana" / "prometheus-scrape.yaml").read_text())
    rules = job["metric_relabel_configs"]
    renamed = {relabel({"__name__": name}, rules)["__name__"] for name in exported_metric_names(scrape)}
    assert renamed >= VLLM_DASHBOARD_NAMES, VLLM_DASHBOARD_NAMES - renamed
    assert relabel({"__name__": "tokend:num_requests_running", "group": "1"}, rules)["engine"] == "1"
    assert "engine" not in relabel({"__name__": "tokend:prompt_tokens_total"}, rules)  # no group, no engine label
