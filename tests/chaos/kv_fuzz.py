"""The prefill worker's KV pull socket (kv-*.ipc): junk frames, and PullPages/LockPages/UnlockPages of guessed or
harvested lease ids with no, short or wrong tokens and duplicate page ids. Every well-formed one must be answered
with a refusal and no tensor frames; junk is dropped unanswered."""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq
from hypothesis import strategies as st

from chaos.report import Outcome
from gpu_runtime.kv_transfer.wire import REPLY_DECODER, LockPages, PagesReply, PullPages, UnlockPages

_encode = msgspec.msgpack.Encoder().encode


def kv_socket(runtime_dir: Path) -> str | None:
    """The prefill worker's pull socket, if the daemon has one."""
    found = sorted(str(path) for path in runtime_dir.glob("kv-*.ipc"))
    return found[0] if found else None


def lease_ids_in(entries: list[dict]) -> list[str]:
    """Real lease ids (usage-record ids, as the request_admitted lines show them) to aim forged requests at."""
    return sorted({str(e["record_id"]) for e in entries if e.get("record_id")})[:20] or ["000000000000-1"]


def _tokens() -> st.SearchStrategy:
    return st.one_of(st.just(b""), st.binary(min_size=32, max_size=32), st.binary(max_size=31))


def kv_request(known_leases: list[str]) -> st.SearchStrategy:
    """(kind, frames): "request" frames are one well-formed message; "junk" frames are anything else."""
    guessed = st.one_of(
        st.sampled_from(known_leases),
        st.tuples(st.binary(min_size=6, max_size=6), st.integers(0, 99)).map(lambda t: f"{t[0].hex()}-{t[1]}"),
    )
    pages = st.one_of(
        st.lists(st.integers(0, 1 << 20), max_size=16),
        st.tuples(st.integers(0, 64), st.integers(2, 512)).map(lambda t: [t[0]] * t[1]),  # one page, many times
    )
    requests = st.one_of(
        st.builds(PullPages, guessed, pages, _tokens()),
        st.builds(LockPages, guessed, pages, _tokens()),
        st.builds(UnlockPages, guessed, _tokens()),
    ).map(lambda message: ("request", [_encode(message)]))
    junk = st.one_of(
        st.binary(max_size=300).map(lambda data: [data]),
        st.just([b"\x80\x04\x95junk."]),  # a pickle's opening
        st.lists(st.binary(max_size=64), min_size=2, max_size=4),
    ).map(lambda frames: ("junk", frames))
    return st.one_of(requests, junk)


class KvSender:
    """Junk on one DEALER socket (never answered); each well-formed request on a fresh one, whose reply it judges."""

    def __init__(self, context: zmq.Context, path: str, timeout: float):
        self._context, self._address, self._timeout_ms = context, f"ipc://{path}", int(timeout * 1000)
        self._junk = self._socket()

    def _socket(self) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDTIMEO, self._timeout_ms)
        socket.connect(self._address)
        return socket

    def close(self) -> None:
        self._junk.close(linger=0)

    def send(self, value: tuple[str, list[bytes]]) -> Outcome:
        kind, frames = value
        try:
            if kind == "junk":
                self._junk.send_multipart(frames)
                return Outcome("junk sent (dropped unanswered)")
            return self._request(frames)
        except zmq.Again:
            return Outcome("not sent: receiver gone (send timeout)")

    def _request(self, frames: list[bytes]) -> Outcome:
        socket = self._socket()
        try:
            socket.send_multipart(frames)
            if not socket.poll(self._timeout_ms):
                return Outcome("no reply", "hung", "a well-formed request was not answered")
            reply = socket.recv_multipart()
        finally:
            socket.close(linger=0)
        try:
            header = REPLY_DECODER.decode(reply[0])
        except msgspec.DecodeError as error:
            return Outcome("undecodable reply", "bad_answers", str(error)[:200])
        if isinstance(header, PagesReply) and header.error and len(reply) == 1:
            return Outcome("refused")
        return Outcome(f"served: {type(header).__name__}", "not_refused", f"{len(reply)} frames: {header}"[:300])
