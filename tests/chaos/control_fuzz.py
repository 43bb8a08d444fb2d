"""The control channel's sockets in the runtime directory (the supervisor's daemon-control.ipc, the frontend's
frontend-control.ipc): junk bytes, and Signed envelopes around real messages (a rollout, a scale to zero, an empty
tenant set, an empty worker set) with a MAC made without the per-boot secret. Nothing answers: each must be dropped
and logged (forged_message, dropped_bad_message), which the audit after the run counts."""

from __future__ import annotations

import msgspec
from hypothesis import strategies as st

from chaos.ipc_fuzz import IpcSender
from frontend.control_messages import (
    DAEMON_SOCKET_FILE,
    FRONTEND_SOCKET_FILE,
    RolloutCommand,
    ScaleCommand,
    Signed,
    Stamped,
    TenantsUpdate,
    WorkerSet,
)

SOCKET_FILES = (DAEMON_SOCKET_FILE, FRONTEND_SOCKET_FILE)
REFUSAL_EVENTS = ("forged_message", "dropped_bad_message", "replayed_message")
_encode = msgspec.msgpack.Encoder().encode
# What a forger would want each end to take: the supervisor a rollout or a scale to nothing, the frontend an empty
# tenant set (every key revoked) or an empty worker set (nothing to route to). Any of them taken fails a canary.
_FORGERIES = (
    RolloutCommand("forged", "tokend-tiny-random", "/tmp/forged", strategy="in-place"),
    ScaleCommand("tokend-tiny-random", serving=0, standby=0, reason="forged"),
    TenantsUpdate(version=1 << 30, tenants=[]),
    WorkerSet(version=1 << 30, workers=[], rollouts=[], drain_timeout_s=0.0, on_drain_timeout="abort"),
)


def _forged(spec: tuple[str, str, str, int, int, bytes]) -> bytes:
    sender, boot, to, seq, which, mac = spec
    stamp = Stamped(boot, to, seq, msgspec.Raw(_encode(_FORGERIES[which % len(_FORGERIES)])))
    return _encode(Signed(sender, _encode(stamp), mac))


_hex = st.binary(min_size=16, max_size=16).map(bytes.hex)
forged_envelope = st.tuples(
    st.sampled_from(["frontend", "daemon", "", "scheduler"]),
    _hex,
    st.one_of(st.just(""), _hex),
    st.one_of(st.integers(0, 3), st.integers(0, (1 << 63) - 1)),
    st.integers(0, 3),
    st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40)),
).map(_forged)
# (which socket, the bytes): one frame each, so that each input is one logged refusal.
control_input = st.tuples(
    st.sampled_from(SOCKET_FILES),
    st.one_of(
        forged_envelope,
        st.binary(max_size=300),
        st.tuples(st.text(max_size=12), st.binary(max_size=64), st.binary(max_size=40)).map(
            lambda t: _encode(Signed(*t))  # an envelope around bytes that are no stamp
        ),
    ),
)


class ControlSender:
    """One PUSH socket per control socket file."""

    def __init__(self, context, runtime_dir, timeout: float):
        self._senders = {name: IpcSender(context, str(runtime_dir / name), timeout) for name in SOCKET_FILES}

    def close(self) -> None:
        for sender in self._senders.values():
            sender.close()

    def send(self, value: tuple[str, bytes]):
        name, data = value
        return self._senders[name].send(data)


def family(value: tuple[str, bytes]) -> str:
    kind = "signed" if value[1][:1] == b"\x93" else "other"  # a Signed envelope is a 3-array
    return f"{value[0]}: {kind}"
