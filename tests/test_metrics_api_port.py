"""The engine's metrics where vLLM users scrape them: on the API (HTTP) port's /metrics, with vLLM's request-phase
and token histograms, behind the metrics token when one is set, and never a `_created` series."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from daemon_harness import ROOT, Daemon, free_port
from dashboard_queries import dashboard_queries, exported_metric_names, metric_names
from exposition import sample_names, scrape, status_of, total

from frontend.gateway.spec import GatewaySpec
from tokend.v1 import tokend_pb2 as pb

METRICS_TOKEN = "metrics-token-for-the-api-port"
MODEL = "tokend-tiny-random"
PHASES = ("queue", "prefill", "decode", "inference")
NEW_HISTOGRAMS = [f"tokend:request_{phase}_time_seconds" for phase in PHASES] + [
    "tokend:request_prompt_tokens",
    "tokend:request_generation_tokens",
]
# (prompt, max_tokens): distinct first characters, so no prompt shares a cached page with another
REQUESTS = [("Alpha and so on", 5), ("Bravo, once more", 9), ("Charlie", 3), ("Delta " * 12, 12), ("Echo!", 1)]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("config") / "tokend.toml"
    config.write_text(f'metrics_token_sha256 = "{hashlib.sha256(METRICS_TOKEN.encode()).hexdigest()}"\n')
    with Daemon("--config", str(config)) as running:
        yield running


@pytest.fixture(scope="module")
def finished(daemon):
    """Runs REQUESTS concurrently; returns each one's final usage, as its client saw it."""

    def run(prompt_and_max):
        prompt, max_tokens = prompt_and_max
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return list(daemon.generation.Generate(request, timeout=120))[-1].usage

    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(run, REQUESTS))


def api_metrics(daemon) -> str:
    return scrape(f"{daemon.http_url}/metrics", METRICS_TOKEN)


def settled_api_metrics(daemon, usages) -> str:
    """The API port's text once the schedulers' load reports have caught up with every step of the requests: a
    request computes its uncached prompt tokens, then one token per decode after the first (ignore_eos: none stop
    early)."""
    computed = sum(u.prompt_tokens - u.cached_tokens + u.completion_tokens - 1 for u in usages)

    def caught_up() -> str | None:
        text = api_metrics(daemon)
        return text if total(text, "tokend:iteration_tokens_total_sum") >= computed else None

    return daemon.wait_for(caught_up, timeout=60)


def test_the_api_port_serves_the_engine_metrics_beside_the_gateways_own(daemon, finished):
    text = settled_api_metrics(daemon, finished)
    names = sample_names(text)
    for name in (
        "tokend:num_requests_running",
        "tokend:num_requests_waiting",
        "tokend:kv_cache_usage_perc",
        "tokend:time_to_first_token_seconds_count",
        "tokend:e2e_request_latency_seconds_count",
        "tokend:http_requests_total",  # the gateway's own
    ):
        assert name in names, name
    assert total(text, "tokend:engine_metrics_up") == 1
    assert total(text, "tokend:num_requests_running", model_name=MODEL) == 0  # every request has ended
    # The engine's series are the metrics port's, one for one: nothing (a tenant's series included) appears on the
    # API port that the metrics port does not show. Two scrapes a moment apart may straddle a series' first value
    # (the autoscaler's first export comes a tick after its first load reports): they agree once both show it.

    def ports_agree() -> bool:
        api = sample_names(settled_api_metrics(daemon, finished))
        engine = sample_names(scrape(f"http://{daemon.host}:{daemon.metrics_port}/metrics", METRICS_TOKEN))
        gateway_own = {name for name in api if name.startswith(("tokend:http_", "tokend:engine_metrics_up"))}
        return api - gateway_own == engine and "tokend:desired_replicas" in engine

    daemon.wait_for(ports_agree, timeout=30)


def test_every_new_histogram_counts_each_finished_request_once(daemon, finished):
    text = settled_api_metrics(daemon, finished)
    for name in [*NEW_HISTOGRAMS, "tokend:e2e_request_latency_seconds"]:
        assert total(text, f"{name}_count", model_name=MODEL) == len(REQUESTS), name
        assert total(text, f"{name}_bucket", model_name=MODEL, le="+Inf") == len(REQUESTS), name


def test_token_histograms_add_up_to_the_usage_the_clients_saw(daemon, finished):
    text = settled_api_metrics(daemon, finished)
    assert total(text, "tokend:request_prompt_tokens_sum") == sum(u.prompt_tokens for u in finished)
    assert total(text, "tokend:request_generation_tokens_sum") == sum(u.completion_tokens for u in finished)
    assert [u.completion_tokens for u in finished] == [max_tokens for _, max_tokens in REQUESTS]


def test_request_phases_add_up(daemon, finished):
    text = settled_api_metrics(daemon, finished)
    seconds = {phase: total(text, f"tokend:request_{phase}_time_seconds_sum") for phase in PHASES}
    assert all(value >= 0 for value in seconds.values()), seconds
    assert seconds["prefill"] + seconds["decode"] == pytest.approx(seconds["inference"], rel=1e-9, abs=1e-9)
    # The phases partition each request's time after its tokenizing: together never more than its whole life, and
    # the queue and prefill never more than its time to first token.
    e2e = total(text, "tokend:e2e_request_latency_seconds_sum")
    ttft = total(text, "tokend:time_to_first_token_seconds_sum")
    assert seconds["queue"] + seconds["inference"] <= e2e + 1e-6, (seconds, e2e)
    assert seconds["queue"] + seconds["prefill"] <= ttft + 1e-6, (seconds, ttft)
    # Requests that made more than one token spent time decoding.
    assert seconds["decode"] > 0


def test_iteration_tokens_count_every_token_each_engine_step_computed(daemon, finished):
    text = settled_api_metrics(daemon, finished)
    if total(text, "tokend:num_preemptions_total") == 0:  # a preempted request computes its tokens again
        computed = sum(u.prompt_tokens - u.cached_tokens + u.completion_tokens - 1 for u in finished)
        assert total(text, "tokend:iteration_tokens_total_sum") == computed
    steps = total(text, "tokend:iteration_tokens_total_count")
    assert steps == total(text, "tokend:iteration_tokens_total_bucket", le="+Inf")
    # Each step computed one token at least; the longest request alone needed one step per token it generated.
    assert max(max_tokens for _, max_tokens in REQUESTS) <= steps <= total(text, "tokend:iteration_tokens_total_sum")


def test_no_created_series_on_either_port(daemon, finished):
    for url in (f"{daemon.http_url}/metrics", f"http://{daemon.host}:{daemon.metrics_port}/metrics"):
        text = scrape(url, METRICS_TOKEN)
        names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
        assert names and not [name for name in names if name.endswith("_created")], url
        assert "_created" not in text, url


def test_the_api_ports_metrics_need_the_metrics_token(daemon):
    url = f"{daemon.http_url}/metrics"
    assert status_of(url) == 401
    assert status_of(url, "a-wrong-token") == 401
    assert status_of(url, METRICS_TOKEN) == 200
    assert status_of(f"http://{daemon.host}:{daemon.metrics_port}/metrics") == 401  # as on the metrics port


def test_a_frontend_that_does_not_answer_costs_the_engine_metrics_not_the_scrape(daemon, finished):
    (frontend,) = daemon.child_pids("tokend: frontend")
    os.kill(frontend, signal.SIGSTOP)
    try:
        text = api_metrics(daemon)  # a 200 after the fetch's timeout, or scrape() raises
    finally:
        os.kill(frontend, signal.SIGCONT)
    assert total(text, "tokend:engine_metrics_up") == 0
    assert "tokend:http_requests_total" in text and "tokend:num_requests_running" not in text
    assert "# engine metrics missing" in text
    daemon.wait_for(lambda: total(api_metrics(daemon), "tokend:engine_metrics_up") == 1, timeout=30)


def test_a_gateway_run_alone_serves_its_own_metrics_only(tmp_path):
    spec = GatewaySpec(grpc_address=f"127.0.0.1:{free_port()}", http_port=free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "gateway.log").open("wb")
    process = subprocess.Popen([sys.executable, "-m", "frontend.gateway", spec.to_json()], cwd=ROOT, env=env,
                               stderr=log)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while status_of(url := f"http://127.0.0.1:{spec.http_port}/metrics") != 200:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            time.sleep(0.1)
        names = sample_names(scrape(url))
        assert names and all(name.startswith("tokend:http_") for name in names), names
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_dashboard_only_queries_metrics_the_daemon_exports(daemon, finished):
    exported = exported_metric_names(settled_api_metrics(daemon, finished))
    dashboard = json.loads((ROOT / "deploy/grafana/tokend-dashboard.json").read_text())
    queried = set().union(*map(metric_names, dashboard_queries(dashboard)))
    assert len(queried) >= 10 and queried <= exported, queried - exported
