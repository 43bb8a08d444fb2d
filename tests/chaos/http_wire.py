"""HTTP/1.1 on a raw socket: sends exactly the bytes given (bad headers included) and reads one answer by a deadline."""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass

_MAX_BODY = 1 << 20


@dataclass(slots=True)
class HttpAnswer:
    """What came back: a status (None: none came) and the body, or for an event stream only its first event."""

    status: int | None
    content_type: str = ""
    body: bytes = b""
    error: str = ""  # why no (whole) answer came: "timeout", "closed", ...
    elapsed_s: float = 0.0

    def json(self) -> object:
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def exchange(port: int, raw: bytes, timeout: float, half_close: bool = False) -> HttpAnswer:
    """Sends `raw` to 127.0.0.1:port and reads the answer. With half_close, our side of the connection is shut
    after sending: a server that waits for more body sees the end instead of waiting forever."""
    started = time.monotonic()
    deadline = started + timeout
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            try:
                sock.sendall(raw)
                if half_close:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server may answer (413, 400) and close before reading everything: read what it said
            answer = _read(sock, deadline)
    except TimeoutError:
        answer = HttpAnswer(None, error="timeout")
    except (ConnectionError, http.client.HTTPException, OSError) as error:
        answer = HttpAnswer(None, error=f"closed: {type(error).__name__}: {error}"[:200])
    answer.elapsed_s = time.monotonic() - started
    return answer


def _read(sock: socket.socket, deadline: float) -> HttpAnswer:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    response = http.client.HTTPResponse(sock, method="POST")
    response.begin()
    content_type = response.getheader("content-type", "")
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    if content_type.startswith("text/event-stream"):
        return HttpAnswer(response.status, content_type, _first_event(response))
    return HttpAnswer(response.status, content_type, response.read(_MAX_BODY))


def _first_event(response: http.client.HTTPResponse) -> bytes:
    """The first `data:` line of an event stream; we then hang up, which must cancel the generation."""
    while True:
        line = response.readline(_MAX_BODY)
        if not line:
            return b""
        if line.startswith(b"data:"):
            return line[5:].strip()
