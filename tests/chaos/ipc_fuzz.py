"""Raw bytes on the daemon's ipc:// sockets (the frontend's output socket, a scheduler's input socket): random
bytes, truncated real-looking messages, wrong field types, deep nesting, lying length headers, multipart frames.

Nothing answers on a PUSH socket: the canaries that follow tell whether the receiver survived."""

from __future__ import annotations

import msgspec
import zmq
from hypothesis import strategies as st

from chaos.junk import any_float, any_int, any_text, json_value, nesting_depth
from chaos.report import Outcome

# Tags of the messages each receiver decodes (gpu_runtime/ipc/messages.py), and some that are nobody's.
TAGS = ("step", "ready", "load", "add", "abort", "hello", "", "Step", "pickle")
_MSGPACK_LIES = (
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xc7\xff\x01",
    b"\xd9\xff",
    b"\xc1",
    b"\x80",
    b"\x90",
)


def _looks_like(tag: str) -> st.SearchStrategy:
    """A map shaped like one of the real messages (right field names, mostly plausible values)."""
    common = {"worker_id": any_text, "incarnation": any_text}
    shapes = {
        "step": {**common, "deltas": st.lists(st.lists(json_value, max_size=9), max_size=3)},
        "ready": {**common, "pid": any_int, "model_name": any_text, "max_model_len": any_int, "vocab_size": any_int},
        "load": {**common, "num_running": any_int, "kv_cache_usage": any_float, "sent_at": any_float},
        "add": {
            "request_id": any_text,
            "prompt_token_ids": st.lists(any_int, max_size=8),
            "priority": any_int,
            "sampling": st.dictionaries(st.text(max_size=12), json_value, max_size=4),
        },
        "abort": {"request_ids": st.lists(any_text, max_size=3)},
        "hello": {"frontend_id": any_text, "proof": any_text},
    }
    fields = shapes.get(tag, {"x": json_value})
    return st.fixed_dictionaries({}, optional=fields).map(lambda d: {"type": tag, **d})


message_map = st.sampled_from(TAGS).flatmap(_looks_like)


def _encode(value: object) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except (OverflowError, TypeError, ValueError):  # an int past 64 bits: msgpack has no form for it
        return b"\xc1"  # the one byte msgpack never uses


def _truncated(spec: tuple[dict, float]) -> bytes:
    encoded = _encode(spec[0])
    return encoded[: int(len(encoded) * spec[1])]  # strictly shorter: a map that promises more than it has


def _nested(spec: tuple[int, str, bool]) -> bytes:
    depth, kind, under_field = spec
    opener = b"\x91" if kind == "array" else b"\x81\xa1a"  # [x] or {"a": x}
    inner = opener * depth + b"\xc0"
    return b"\x82\xa4type\xa4step\xa1x" + inner if under_field else inner  # {"type": "step", "x": ...}


ipc_payload = st.one_of(
    st.binary(max_size=300),
    st.tuples(message_map, st.floats(0, 1, exclude_max=True)).map(_truncated),
    message_map.map(_encode),
    json_value.map(_encode),
    st.tuples(nesting_depth, st.sampled_from(["array", "map"]), st.booleans()).map(_nested),
    st.tuples(st.sampled_from(_MSGPACK_LIES), st.binary(max_size=16)).map(b"".join),
    st.lists(st.binary(max_size=64), min_size=2, max_size=4),  # a multipart message: several frames at once
)


class IpcSender:
    """A PUSH socket connected to one receiver's ipc:// path; a send that cannot go out in time is counted, not
    waited on forever."""

    def __init__(self, context: zmq.Context, path: str, timeout: float):
        self.socket = context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        self.socket.connect(f"ipc://{path}")

    def close(self) -> None:
        self.socket.close(linger=0)

    def send(self, payload: bytes | list[bytes]) -> Outcome:
        try:
            if isinstance(payload, list):
                self.socket.send_multipart(payload)
                return Outcome("sent (multipart)")
            self.socket.send(payload)
        except zmq.Again:
            return Outcome("not sent: receiver gone (send timeout)")
        return Outcome("sent")


def family(payload: bytes | list[bytes]) -> str:
    """A rough name for a payload's kind, to tell which inputs preceded a failed canary."""
    if isinstance(payload, list):
        return "multipart"
    if payload[:1] in (b"\x91", b"\x81") and len(payload) > 64:
        return "deep nesting"
    if payload.startswith(b"\x82\xa4type\xa4step\xa1x"):
        return "deep nesting under a field"
    return "other"
