"""/metrics beyond loopback with tenants, in process: with no metrics_token_sha256 the API port's /metrics refuses
every scrape (403, naming the key), while the operator's own metrics port stays open to its scraper; with a token set
both want it; on loopback they stay open."""

from __future__ import annotations

import asyncio
import hashlib
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter

from frontend.gateway.metrics_endpoint import MetricsEndpoint
from frontend.metrics_server import start_metrics_server

pytestmark = pytest.mark.fast

TOKEN = "metrics-secret"
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()


@pytest.fixture
def registry():
    registry = CollectorRegistry()
    Counter("tokend_probe", "a series to find", registry=registry).inc()
    return registry


def _scrape_port(registry, token_sha256: str, require: bool, bearer: str = "") -> tuple[int, str]:
    server = start_metrics_server("127.0.0.1", 0, registry, token_sha256)  # never closed for want of a token
    try:
        request = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/metrics")
        if bearer:
            request.add_header("Authorization", f"Bearer {bearer}")
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()
    finally:
        server.shutdown()
        server.server_close()


def _scrape_api_port(registry, token_sha256: str, require: bool, bearer: str = "") -> tuple[int, str]:
    endpoint = MetricsEndpoint(registry, "", token_sha256, require)
    headers = {"authorization": f"Bearer {bearer}"} if bearer else {}
    reply = asyncio.run(endpoint.response(SimpleNamespace(headers=headers)))
    return reply.status_code, reply.body.decode()


def test_a_public_host_with_tenants_and_no_token_refuses_every_api_port_scrape_naming_the_key(registry):
    status, text = _scrape_api_port(registry, "", True)
    assert status == 403 and "metrics_token_sha256" in text and "tokend_probe" not in text
    assert _scrape_api_port(registry, "", True, "anything")[0] == 403


def test_the_metrics_port_stays_open_to_the_operators_scraper(registry):
    assert "tokend_probe" in _scrape_port(registry, "", True)[1]


@pytest.mark.parametrize("scrape", [_scrape_port, _scrape_api_port], ids=["metrics_port", "api_port"])
def test_with_the_token_set_a_scrape_needs_it_and_on_loopback_none_is_needed(registry, scrape):
    assert scrape(registry, TOKEN_SHA, True)[0] == 401
    status, text = scrape(registry, TOKEN_SHA, True, TOKEN)
    assert status == 200 and "tokend_probe" in text
    assert "tokend_probe" in scrape(registry, "", False)[1]
