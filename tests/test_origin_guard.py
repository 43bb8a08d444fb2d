"""The gateway's OriginGuard: a web page cannot post a simple (non-JSON) body, nor reach a loopback gateway through
a rebound DNS name; the clients people use (the openai library, curl, a browser on localhost) are unaffected."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from common.addresses import is_loopback
from frontend.gateway.origin_guard import OriginGuard

pytestmark = pytest.mark.fast


async def _echo(request):
    return JSONResponse({"ok": True})


def _client(listen_host: str) -> TestClient:
    app = Starlette(routes=[Route("/v1/completions", _echo, methods=["POST", "GET"])],
                    middleware=[Middleware(OriginGuard, listen_host=listen_host)])  # fmt: skip
    return TestClient(app, base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "[::1]:8000", "127.0.0.2", "app.localhost"])
def test_loopback_names_are_served(host):
    reply = _client("127.0.0.1").post("/v1/completions", json={}, headers={"Host": host})
    assert reply.status_code == 200


def test_a_rebound_name_is_refused_naming_the_host_header():
    reply = _client("127.0.0.1").post("/v1/completions", json={}, headers={"Host": "attacker.example:8000"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "host" and error["message"].startswith("Host: 'attacker.example:8000'")


def test_a_gateway_the_operator_opened_answers_any_name():
    reply = _client("0.0.0.0").post("/v1/completions", json={}, headers={"Host": "tokend.internal:8000"})
    assert reply.status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_simple_body_that_skips_the_cors_preflight_is_refused(content_type):
    reply = _client("127.0.0.1").post("/v1/completions", content=b"{}", headers={"Content-Type": content_type})
    assert reply.status_code == 415
    assert reply.json()["error"]["param"] == "content-type"


@pytest.mark.parametrize("headers", [{"Content-Type": "application/json; charset=utf-8"}, {}])
def test_json_and_untyped_bodies_are_served(headers):
    assert _client("127.0.0.1").post("/v1/completions", content=b"{}", headers=headers).status_code == 200


def test_loopback_is_recognised_by_name_and_address():
    assert all(map(is_loopback, ["127.0.0.1", "::1", "[::1]", "LOCALHOST", "localhost.", "127.255.0.9"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.1", "localhost.evil.com", "", "::"]))
