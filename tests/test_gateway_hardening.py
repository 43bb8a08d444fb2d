"""The gateway under attack (issue 13): bad integers, deep JSON, odd keys, planted faults, line-breaking characters,
an unreachable frontend, slow request heads and too many connections all get OpenAI-shaped answers."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import msgspec
import pytest
from daemon_harness import ROOT, Daemon, free_port
from harness.local_daemon import PortTaken, start_on_free_ports

from frontend.gateway.calls import sse_event
from frontend.gateway.errors import from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse, nesting_exceeds
from frontend.gateway.spec import GatewaySpec

HEADER_TIMEOUT_S = 2.0  # the lone gateway's; bounds below are multiples of it, never a guess about the machine
LINE_BREAKERS = ("\u2028", "\u2029", "\x85")  # str.splitlines() ends lines at these; json.dumps leaves them raw
GRPC_INTERNALS = ("failed to connect", "ipv4", "connection refused", "127.0.0.1", "socket", "dns", "errno")

# The gateway process as the daemon runs it, plus three routes a test needs: one that fails, one that fails in the
# middle of an SSE stream, one that takes its time. Nothing else is changed.
GATEWAY_WITH_FAULTS = """
import asyncio, sys
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
import frontend.gateway.__main__ as gateway_main

async def fails(request):
    raise RuntimeError("a fault the test planted")

async def fails_mid_stream(request):
    async def events():
        yield 'data: {"first": true}\\n\\n'
        raise RuntimeError("a fault the test planted mid-stream")
    return StreamingResponse(events(), media_type="text/event-stream")

async def slow(request):
    await asyncio.sleep(float(request.query_params["s"]))
    return PlainTextResponse("done")

def build_app_with_faults(spec):
    app = real_build_app(spec)
    app.router.routes += [Route("/fault", fails), Route("/fault/stream", fails_mid_stream), Route("/slow", slow)]
    return app

real_build_app = gateway_main.build_app
gateway_main.build_app = build_app_with_faults
sys.exit(gateway_main.main(sys.argv))
"""


class LoneGateway:
    """A gateway process (with the planted routes) and its log; its frontend address refuses connections."""

    def __init__(self, spec: GatewaySpec, log_path: Path):
        self.spec = spec
        self.url = f"http://127.0.0.1:{spec.http_port}"
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LoneGateway:
        """Starts the gateway and waits until it answers; where its port was taken before it bound it, again on
        another (tests/harness/local_daemon.py)."""
        start_on_free_ports(self._start, self._pick_new_port)
        return self

    def _pick_new_port(self) -> None:
        self.spec = msgspec.structs.replace(self.spec, http_port=free_port())
        self.url = f"http://127.0.0.1:{self.spec.http_port}"

    def _start(self) -> None:
        command = [sys.executable, "-c", GATEWAY_WITH_FAULTS, self.spec.to_json()]
        with self.log_path.open("wb") as log:
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            self.process = subprocess.Popen(command, cwd=ROOT, stderr=log, env=env)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                log = self.log_path.read_text()
                if "Address already in use" in log:
                    raise PortTaken(log)
                raise RuntimeError(f"the gateway did not start:\n{log}")
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _answers(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/metrics", timeout=2).status_code == 200
        return False

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()]  # every line is JSON


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


@pytest.fixture(scope="module")
def refusing_port():
    """A port that is bound but never listens: connecting to it is refused, and nothing else can take it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def _gateway(tmp_path_factory, refusing_port: int, **limits) -> LoneGateway:
    spec = GatewaySpec(grpc_address=f"127.0.0.1:{refusing_port}", http_port=free_port(), **limits)
    return LoneGateway(spec, tmp_path_factory.mktemp("gateway") / "gateway.log")


@pytest.fixture(scope="module")
def lone_gateway(tmp_path_factory, refusing_port):
    with _gateway(tmp_path_factory, refusing_port, header_timeout_s=HEADER_TIMEOUT_S) as gateway:
        yield gateway


def _assert_openai_error(reply: httpx.Response, status: int, type_: str, param: str | None = None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert error["type"] == type_ and error["param"] == param and error["message"], error
    return error


# -- 1. integers out of their protobuf field's range, deep JSON, odd keys: 400s and 401s naming the field ---------

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("completions", {"prompt": [1, -1]}, "prompt"),
        ("completions", {"prompt": [1, 2**32]}, "prompt"),
        ("completions", {"top_k": 2**32}, "top_k"),
        ("completions", {"top_k": -1}, "top_k"),
        ("completions", {"logprobs": 2**32}, "logprobs"),
        ("completions", {"stop_token_ids": [2**32]}, "stop_token_ids"),
        ("completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
        ("completions", {"seed": 2**64}, "seed"),
        ("completions", {"n": 2**70}, "n"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 2**32}, "top_logprobs"),
        ("chat/completions", {"top_k": 2**40}, "top_k"),
        ("chat/completions", {"max_tokens": None, "max_completion_tokens": -1}, "max_completion_tokens"),
    ],
)
def test_integers_out_of_range_are_400s_naming_the_field(daemon, route, fields, param):
    body = {**(CHAT if route.startswith("chat") else COMPLETION), **fields}
    reply = httpx.post(f"{daemon.http_url}/v1/{route}", json=body, timeout=30)
    _assert_openai_error(reply, 400, "invalid_request_error", param)
    assert "Traceback" not in daemon.log()


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_json_nested_too_deep_is_a_400_and_brackets_in_strings_do_not_count(daemon, route):
    base = json.dumps(CHAT if route.startswith("chat") else COMPLETION).encode()
    for body in (_nested(100_000), base[:-1] + b', "extra": ' + _nested(64) + b"}"):  # 65 levels with the object
        reply = httpx.post(f"{daemon.http_url}/v1/{route}", content=body, timeout=30)
        assert "64 levels" in _assert_openai_error(reply, 400, "invalid_request_error")["message"]
    text_of_brackets = json.dumps("[{" * 5000 + '\\"' + "[" * 100)
    body = base[:-1] + b', "user": ' + text_of_brackets.encode() + b', "extra": ' + _nested(63) + b"}"
    assert httpx.post(f"{daemon.http_url}/v1/{route}", content=body, timeout=30).status_code == 200
    assert "Traceback" not in daemon.log()


def test_an_api_key_grpc_cannot_carry_is_a_401(daemon):
    for key in ("Bearer kéy", "Bearer k\u2028y"):
        headers = {"authorization": key.encode()}
        reply = httpx.post(f"{daemon.http_url}/v1/completions", json=COMPLETION, headers=headers, timeout=30)
        _assert_openai_error(reply, 401, "authentication_error")
        _assert_openai_error(httpx.get(f"{daemon.http_url}/v1/models", headers=headers), 401, "authentication_error")
    assert "Traceback" not in daemon.log()


def test_nesting_check_agrees_with_a_recursive_count():
    def depth(value) -> int:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        return 0 if children is None else 1 + max(map(depth, children), default=0)

    rng = random.Random(13)
    leaves = [1, None, "[[{", '"]', "\\", "\\\\[", "é\u2028]"]

    def random_value(levels: int):
        if levels == 0 or rng.random() < 0.2:
            return rng.choice(leaves)
        children = [random_value(levels - 1) for _ in range(rng.randint(0, 3))]
        return children if rng.random() < 0.5 else {f"k{i}{{": child for i, child in enumerate(children)}

    for _ in range(500):
        value = random_value(rng.randint(0, 12))
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5).encode()
        for limit in range(13):
            assert nesting_exceeds(text, limit) == (depth(value) > limit), (text, limit)


# -- 2. one error funnel: an unexpected exception is an OpenAI-shaped 500 with a request id, logged once ----------


def test_an_unexpected_exception_is_an_openai_500_with_a_request_id_logged_once(lone_gateway):
    reply = httpx.get(f"{lone_gateway.url}/fault", timeout=30)
    error = _assert_openai_error(reply, 500, "internal_error")
    request_id = reply.headers["x-request-id"]
    assert request_id in error["message"] and "planted" not in error["message"]
    lines = lone_gateway.log_lines()
    (logged,) = [line for line in lines if request_id in json.dumps(line)]
    assert logged["level"] == "error" and logged["process"] == "gateway" and logged["path"] == "/fault"
    assert "RuntimeError: a fault the test planted" in logged["exception"]
    assert not [line for line in lines if "Exception in ASGI application" in line["event"]]  # uvicorn kept quiet


def test_an_exception_in_a_started_stream_ends_it_with_an_error_event(lone_gateway):
    with httpx.stream("GET", f"{lone_gateway.url}/fault/stream", timeout=30) as reply:
        assert reply.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines() if line]
        request_id = reply.headers["x-request-id"]
    assert events[0] == {"first": True}
    assert events[1]["error"]["type"] == "internal_error" and request_id in events[1]["error"]["message"]
    assert len(events) == 2
    logged = [line for line in lone_gateway.log_lines() if request_id in json.dumps(line)]
    assert len(logged) == 1 and "mid-stream" in logged[0]["exception"]


def test_bytes_that_are_not_http_get_an_openai_400(lone_gateway):
    with socket.create_connection(("127.0.0.1", lone_gateway.spec.http_port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("method", [b"BREW", b"POST"])
def test_a_body_that_is_not_valid_chunking_gets_a_400_and_is_no_incident(daemon, method):
    """The app is already handling the request (a 405, or a completion) when h11 finds the body broken: the
    client gets one 400, and the app's own answer, now without a connection, is not logged as a failure."""
    request = (
        method + b" /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'zz\r\n{"prompt": "hi", "max_tokens": 2}'
    )
    with socket.create_connection(("127.0.0.1", daemon.http_port), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = _read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400") and len(re.findall(rb"HTTP/1\.1 \d{3} ", answer)) == 1
    assert len(daemon.generate("still serving", max_tokens=2)) >= 1  # the app's handling has surely ended
    assert not daemon.log_entries("unexpected_error") and "without completing" not in daemon.log()


# -- 3. SSE and JSON text never hold a character that a line-splitting client breaks at ---------------------------


def test_sse_events_and_json_bodies_escape_what_splitlines_breaks_at():
    payload = {"text": "one" + "two".join(LINE_BREAKERS) + "é\n"}
    raw = json.dumps(payload, ensure_ascii=False)
    assert len(raw.splitlines()) == 4  # what an unescaped event would look like to httpx's iter_lines
    event = sse_event(payload)
    assert not any(character in event for character in LINE_BREAKERS) and "é" in event
    lines = list(httpx.Response(200, content=event.encode()).iter_lines())
    assert lines[1:] == [""] and json.loads(lines[0].removeprefix("data: ")) == payload
    body = LineSafeJSONResponse(payload).body.decode()
    assert not any(character in body for character in LINE_BREAKERS) and json.loads(body) == payload


def test_a_real_stream_holds_no_raw_line_breakers(daemon):
    body = {"prompt": "x", "max_tokens": 200, "temperature": 1.0, "ignore_eos": True, "stream": True, "logprobs": 5}
    with httpx.stream("POST", f"{daemon.http_url}/v1/completions", json=body, timeout=120) as reply:
        raw = b"".join(reply.iter_bytes())
    assert reply.status_code == 200
    assert not any(character.encode() in raw for character in LINE_BREAKERS)
    events = [line for line in httpx.Response(200, content=raw).iter_lines() if line.startswith("data: {")]
    assert len(events) >= 2 and len(events) == raw.count(b"data: {")  # no event was cut into lines
    assert all(json.loads(line.removeprefix("data: ")) for line in events)


# -- 4. an unreachable frontend: clean 503s, no gRPC internals ----------------------------------------------------


def test_an_unreachable_frontend_is_a_clean_503_with_retry_after(lone_gateway, refusing_port):
    url = lone_gateway.url
    replies = [
        httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=30),
        httpx.post(f"{url}/v1/completions", json={**COMPLETION, "stream": True}, timeout=30),
        httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30),
        httpx.get(f"{url}/v1/models", timeout=30),
        httpx.get(f"{url}/health", timeout=30),
    ]
    for reply in replies:
        error = _assert_openai_error(reply, 503, "service_unavailable")
        assert int(reply.headers["retry-after"]) >= 1
        message = error["message"].lower()
        assert not any(internal in message for internal in GRPC_INTERNALS) and str(refusing_port) not in message


@pytest.mark.parametrize(
    "details",
    [
        "server is draining; retry on another instance",
        "model 'tokend-tiny-random' has no scheduler up; retry",
        "the scheduler of model 'm' stopped; retry",
    ],
)
def test_the_frontends_own_unavailable_messages_pass_through(details):
    error = from_grpc(grpc.StatusCode.UNAVAILABLE, details, chat=False)
    assert (error.status, error.message) == (503, details)


@pytest.mark.parametrize(
    ("code", "details", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9", 503),
        (grpc.StatusCode.UNAVAILABLE, "Socket closed", 503),
        (grpc.StatusCode.UNAVAILABLE, "errors resolving x:1: [DNS resolution failed]", 503),
        (grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>: a secret", 503),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 504),
    ],
)
def test_grpc_internal_words_are_replaced(code, details, status):
    error = from_grpc(code, details, chat=True)
    assert error.status == status and error.param is None
    assert details not in error.message and "retry" in error.message


# -- 5. slow request heads are cut at the header timeout; connections beyond the cap get a 503 ---------------------


def _read_until_closed(sock: socket.socket) -> bytes:
    chunks = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def _seconds_until_closed(sock: socket.socket, limit_s: float) -> float:
    """Trickles header lines into a request head that never ends, as slowloris does, until the server closes."""
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while time.monotonic() - started < limit_s:
            if select.select([sock], [], [], 0.2)[0] and not sock.recv(65536):
                break
            sock.sendall(b"X-Slow: 1\r\n")
    return time.monotonic() - started


def test_a_trickled_request_head_is_closed_at_the_header_timeout(lone_gateway):
    with socket.create_connection(("127.0.0.1", lone_gateway.spec.http_port), timeout=30) as sock:
        elapsed = _seconds_until_closed(sock, 10 * HEADER_TIMEOUT_S)
    assert HEADER_TIMEOUT_S * 0.5 <= elapsed < HEADER_TIMEOUT_S * 5


def test_the_header_timeout_holds_for_each_request_of_a_kept_alive_connection(lone_gateway):
    with socket.create_connection(("127.0.0.1", lone_gateway.spec.http_port), timeout=30) as sock:
        sock.sendall(b"GET /slow?s=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        elapsed = _seconds_until_closed(sock, 10 * HEADER_TIMEOUT_S)
    assert HEADER_TIMEOUT_S * 0.5 <= elapsed < HEADER_TIMEOUT_S * 5


def test_a_request_slower_than_the_header_timeout_is_not_cut(lone_gateway):
    reply = httpx.get(f"{lone_gateway.url}/slow", params={"s": 2 * HEADER_TIMEOUT_S}, timeout=60)
    assert (reply.status_code, reply.text) == (200, "done")


def test_connections_beyond_the_cap_get_an_openai_503(tmp_path_factory, refusing_port):
    with _gateway(tmp_path_factory, refusing_port, max_connections=3, header_timeout_s=120.0) as gateway:
        held = [socket.create_connection(("127.0.0.1", gateway.spec.http_port), timeout=30) for _ in range(3)]
        try:
            # uvicorn accepts the held connections in its own time: ask until the fourth is the one too many.
            reply = _poll(lambda: httpx.get(f"{gateway.url}/metrics", timeout=30), lambda r: r.status_code == 503)
            _assert_openai_error(reply, 503, "service_unavailable")
            assert reply.headers["connection"] == "close" and reply.headers["retry-after"] == "1"
        finally:
            for sock in held:
                sock.close()
        assert _poll(lambda: httpx.get(f"{gateway.url}/metrics", timeout=30), lambda r: r.status_code == 200)


def _poll(ask, done, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while not done(answer := ask()):
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)
    return answer
