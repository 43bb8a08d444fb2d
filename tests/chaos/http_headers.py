"""Hypothesis strategies for whole HTTP requests with fuzzed request lines and headers: Authorization garbage (non-ASCII
included), content types, Content-Length that lies, chunked bodies, too many or too large headers."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st

from chaos.junk import weighted

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
LENGTH_MODES = (
    "exact",
    "exact",
    "exact",
    "missing",
    "shorter",
    "longer",
    "zero",
    "negative",
    "garbage",
    "duplicate",
    "huge",
    "chunked",
    "chunked_bad",
    "both",
)
# Modes after which an honest server may wait for bytes that never come: our side is shut, so it sees the end.
_ILL_FRAMED = frozenset({"longer", "chunked_bad", "both"})


@dataclass(frozen=True, slots=True)
class RawRequest:
    data: bytes
    half_close: bool  # shut our side after sending: the request is ill-framed on purpose


header_value = st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
header_name = st.one_of(
    st.text(TOKEN_CHARS, min_size=1, max_size=20).map(str.encode),
    st.sampled_from([b"", b" X", b"X Y", b"X:Y", b"\xff", b"Content-Length ", b"Host"]),
)


def authorization(fuzz_key: str) -> st.SearchStrategy:
    key = fuzz_key.encode()
    return weighted(
        (1, st.none()),
        (4, st.just(b"Bearer " + key)),
        (
            2,
            st.sampled_from(
                [
                    b"Bearer",
                    b"Bearer ",
                    b"bearer " + key,
                    b"Bearer  " + key + b" ",
                    b"Basic Zm9vOmJhcg==",
                    b"Bearer " + key + b"\x00",
                    b"Bearer " + b"k" * 40_000,
                ]
            ),
        ),
        (2, st.text(max_size=40).map(lambda t: b"Bearer " + t.encode())),  # non-ASCII as UTF-8
        (1, st.text(max_size=20).map(lambda t: b"Bearer " + t.encode("latin-1", errors="replace"))),
        (1, header_value),
    )


content_type = st.one_of(
    st.none(),
    st.sampled_from(
        [
            b"application/json",
            b"application/json; charset=utf-8",
            b"application/json; charset=utf-16",
            b"text/plain",
            b"application/x-www-form-urlencoded",
            b"multipart/form-data; boundary=x",
            b"",
        ]
    ),
    header_value,
)
method = st.sampled_from([b"POST"] * 6 + [b"GET", b"PUT", b"DELETE", b"OPTIONS", b"BREW", b"post"])
path = st.sampled_from(
    [
        b"/v1/completions",
        b"/v1/chat/completions",
        b"/v1/completions/",
        b"/v1//completions",
        b"/v1/completions?x=1",
        b"/%00",
        b"/v1/models",
        b"/" + b"a" * 9000,
        b"*",
    ]
)
version = st.sampled_from([b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"FOO"])
num_filler_headers = st.sampled_from([0, 0, 0, 0, 50, 99, 100, 101, 150])
injection = st.sampled_from([b"", b"", b"", b"", b"x\r\nX-Injected: 1", b"x\nX-Injected: 1", b"x\r\n\r\n"])


def body_for(path: bytes, stream: bool) -> bytes:
    common = {"max_tokens": 2, "stream": stream}
    if b"chat" in path:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], **common}).encode()
    return json.dumps({"prompt": "hi", **common}).encode()


def raw_requests(fuzz_key: str) -> st.SearchStrategy:
    parts = st.fixed_dictionaries(
        {
            "method": method,
            "path": path,
            "version": version,
            "authorization": authorization(fuzz_key),
            "content_type": content_type,
            "length_mode": st.sampled_from(LENGTH_MODES),
            "extra": st.lists(st.tuples(header_name, header_value), max_size=4),
            "filler": num_filler_headers,
            "injection": injection,
            "stream": st.booleans(),
            "shift": st.integers(1, 64),
        }
    )
    return parts.map(_assemble)


def _assemble(p: dict) -> RawRequest:
    body = body_for(p["path"], p["stream"])
    headers = [(b"Host", b"127.0.0.1"), (b"Connection", b"close")]
    if p["authorization"] is not None:
        headers.append((b"Authorization", p["authorization"]))
    if p["content_type"] is not None:
        headers.append((b"Content-Type", p["content_type"]))
    headers += p["extra"] + [(f"X-Filler-{i}".encode(), b"v") for i in range(p["filler"])]
    if p["injection"]:
        headers.append((b"X-Note", p["injection"]))
    framing, body = _framing(p["length_mode"], body, p["shift"])
    head = b"%s %s %s\r\n" % (p["method"], p["path"], p["version"])
    head += b"".join(name + b": " + value + b"\r\n" for name, value in headers + framing)
    half_close = p["length_mode"] in _ILL_FRAMED or bool(p["injection"])
    return RawRequest(head + b"\r\n" + body, half_close)


def _framing(mode: str, body: bytes, shift: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The Content-Length / Transfer-Encoding headers for the mode, and the body bytes to send after them."""
    length = str(len(body)).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return {
        "exact": ([(b"Content-Length", length)], body),
        "missing": ([], body),
        "shorter": ([(b"Content-Length", str(max(0, len(body) - shift)).encode())], body),
        "longer": ([(b"Content-Length", str(len(body) + shift).encode())], body),
        "zero": ([(b"Content-Length", b"0")], body),
        "negative": ([(b"Content-Length", b"-1")], body),
        "garbage": ([(b"Content-Length", b"1e3")], body),
        "duplicate": ([(b"Content-Length", length), (b"Content-Length", str(len(body) + shift).encode())], body),
        "huge": ([(b"Content-Length", str(2**64 + shift).encode())], body),
        "chunked": ([(b"Transfer-Encoding", b"chunked")], chunked),
        "chunked_bad": ([(b"Transfer-Encoding", b"chunked")], b"zz\r\n" + body),
        "both": ([(b"Content-Length", length), (b"Transfer-Encoding", b"chunked")], body),
    }[mode]
