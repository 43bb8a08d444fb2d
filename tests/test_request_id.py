"""One id per request: the client's X-Request-Id (or the gateway's own) names it in the response header, the OpenAI
`id`, the gRPC request_id, the usage ledger and the frontend's log lines."""

from __future__ import annotations

import httpx
import openai
import pytest
from daemon_harness import Daemon

from frontend.gateway.request_ids import MAX_CHARS
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME

MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ledger_ids(daemon: Daemon, prefix: str) -> list[str]:
    with daemon.ledger() as ledger:
        query = "SELECT request_id FROM usage WHERE request_id LIKE ? ORDER BY request_id"
        rows = ledger.execute(query, (prefix + "%",))
        return [row["request_id"] for row in rows]


def _frontend_lines(daemon: Daemon, request_id: str) -> list[dict]:
    return [entry for entry in daemon.log_entries(request_id=request_id) if entry.get("process") == "frontend"]


def test_a_client_request_id_is_the_requests_id_in_response_ledger_and_frontend_log(daemon, client):
    raw = client.chat.completions.with_raw_response.create(
        model=TINY_RANDOM_MODEL_NAME, messages=MESSAGES, max_tokens=4, extra_headers={"X-Request-Id": "abc-123"}
    )
    assert raw.headers["x-request-id"] == "abc-123"
    assert raw.parse().id == "chatcmpl-abc-123"
    assert _ledger_ids(daemon, "abc-123") == ["abc-123"]
    lines = daemon.wait_for(lambda: _frontend_lines(daemon, "abc-123"), timeout=30)
    assert {"request_admitted", "request_finished"} <= {line["event"] for line in lines}


def test_each_of_n_choices_is_the_request_id_with_its_index(daemon, client):
    stream = client.completions.with_raw_response.create(
        model=TINY_RANDOM_MODEL_NAME,
        prompt="Hello",
        max_tokens=3,
        n=2,
        stream=True,
        extra_headers={"X-Request-Id": "n2"},
    )
    assert stream.headers["x-request-id"] == "n2"
    assert {chunk.id for chunk in stream.parse()} == {"cmpl-n2"}
    assert _ledger_ids(daemon, "n2") == ["n2-0", "n2-1"]


def test_without_the_header_the_gateway_makes_one_and_uses_it_alike(daemon, client):
    raw = client.completions.with_raw_response.create(model=TINY_RANDOM_MODEL_NAME, prompt="Hello", max_tokens=2)
    request_id = raw.headers["x-request-id"]
    assert raw.parse().id == f"cmpl-{request_id}"
    assert _ledger_ids(daemon, request_id) == [request_id]


@pytest.mark.parametrize("value", [b"caf\xe9", b"x" * (MAX_CHARS + 1)], ids=["not-ascii", "too-long"])
def test_a_bad_request_id_is_a_400_naming_the_header(daemon, value):
    reply = httpx.post(
        f"{daemon.http_url}/v1/completions",
        json={"model": TINY_RANDOM_MODEL_NAME, "prompt": "Hello", "max_tokens": 2},
        headers={"X-Request-Id": value},
        timeout=30,
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith("X-Request-Id:")
    assert reply.headers["x-request-id"] != value.decode("latin-1")  # refused under an id of the gateway's own
