"""The signed control channel between the daemon and its frontend: what each side accepts, over real sockets.

Only the daemon and its frontend hold the per-boot secret, so only their messages get through: anything signed with
another secret, a message one side signed passed off as the other's, a pickle, or plain garbage is dropped; and a
genuine message sent again (or one of a frontend's earlier incarnation, or sent to one) is dropped as a replay.
"""

from __future__ import annotations

import os
import pickle
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import structlog
import zmq
from structlog.testing import capture_logs

from common.lanes import DrainAction, Pool, Role, RolloutPhase, RolloutStrategy, WorkerState
from daemon.control_channel import ControlChannel
from frontend.control_messages import (
    DAEMON_SOCKET_FILE,
    FRONTEND_SOCKET_FILE,
    CommandResult,
    ControlCodec,
    ControlHello,
    LiveLinks,
    Replayed,
    RolloutCommand,
    RolloutStatus,
    ScaleCommand,
    Signed,
    Stamped,
    TenantsApplied,
    TenantsUpdate,
    ToDaemon,
    ToFrontend,
    WorkerInfo,
    WorkerSet,
)
from frontend.spec import TenantSpec
from gpu_runtime.ipc.peer_auth import PeerAuth

SECRET = secrets.token_bytes(32)
_DEADLINE_S = 10.0  # only a bound for messages that do arrive; nothing asserts how fast


def daemon_codec(secret: bytes = SECRET) -> ControlCodec:
    return ControlCodec(PeerAuth(secret), "daemon", ToDaemon)


def frontend_codec(secret: bytes = SECRET) -> ControlCodec:
    return ControlCodec(PeerAuth(secret), "frontend", ToFrontend, addressed_only=True)


def connected() -> tuple[ControlCodec, ControlCodec]:
    """A daemon and a frontend after the frontend's hello: the daemon addresses the frontend from then on."""
    daemon, frontend = daemon_codec(), frontend_codec()
    assert daemon.decode(frontend.encode(ControlHello(frontend.boot))) == ControlHello(frontend.boot)
    return daemon, frontend


def worker_set(version: int = 3) -> WorkerSet:
    worker = WorkerInfo("m/cpu@1", "m", "cpu", "cpu", "ipc:///run/tokend/m-cpu-1.ipc", 1, "/weights/v2",
                        WorkerState.SERVING, role=Role.DECODE, pid=4242)  # fmt: skip
    rollout = RolloutStatus("m", RolloutPhase.ROLLING, 1, "/weights/v2", "/weights/v1", RolloutStrategy.SURGE, 0,
                            events=["12:00:00 worker_starting worker=m/cpu@1"])  # fmt: skip
    return WorkerSet(version, [worker], [rollout], drain_timeout_s=60.0, on_drain_timeout=DrainAction.MIGRATE)


TO_DAEMON = [
    ControlHello("frontend-1"),
    ScaleCommand("m", 2, 1, "ttft"),
    ScaleCommand("m", 1, 0, "quiet", Pool.PREFILL),
    RolloutCommand("c1", "m", "/weights/v2", strategy="in-place", canary_percent=10),
    RolloutCommand("c2", "m", "", rollback=True),
    TenantsApplied(2),
    LiveLinks(["m/0", "m/spare0@1"]),
]
TO_FRONTEND = [
    worker_set(),
    CommandResult("c1", error="canary_percent: must be in [0, 100], got 101", code="INVALID_ARGUMENT"),
    CommandResult("c2", rollout=worker_set().rollouts[0]),
    TenantsUpdate(2, [TenantSpec("alice", "ab" * 32, models=["m"], admin=True)]),
]


@pytest.mark.parametrize("message", TO_DAEMON, ids=lambda m: type(m).__name__)
def test_what_the_frontend_sends_the_daemon_reads(message):
    assert daemon_codec().decode(frontend_codec().encode(message)) == message


@pytest.mark.parametrize("message", TO_FRONTEND, ids=lambda m: type(m).__name__)
def test_what_the_daemon_sends_the_frontend_reads(message):
    daemon, frontend = connected()
    assert frontend.decode(daemon.encode(message)) == message


@pytest.mark.parametrize(
    ("message", "field", "typo"),
    [
        (worker_set(), "role", "prefil"),
        (worker_set(), "phase", "rolled"),
        (ScaleCommand("m", 1, 0, "q"), "pool", "decod"),
    ],  # fmt: skip
)
def test_a_misspelt_role_phase_or_pool_does_not_decode(message, field, typo):
    data = msgspec.to_builtins(message)
    target = data if field == "pool" else data["workers" if field == "role" else "rollouts"][0]
    target[field] = typo
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value"):
        msgspec.convert(data, type(message))


def test_a_message_signed_with_another_secret_is_refused():
    forger = frontend_codec(secrets.token_bytes(32))
    assert daemon_codec().decode(forger.encode(ControlHello("frontend-1"))) is None
    forged_daemon = daemon_codec(secrets.token_bytes(32))
    frontend = frontend_codec()
    forged_daemon.peer_boot = frontend.boot
    assert frontend.decode(forged_daemon.encode(worker_set())) is None


def test_a_message_one_side_signed_does_not_pass_as_the_other_sides():
    # The daemon's own message (a command it might answer) sent back to it, as is and with its sender relabelled:
    # its MAC names the daemon, so it is not the frontend's.
    command = RolloutCommand("c1", "m", "/weights/evil")
    body = msgspec.msgpack.encode(Stamped("frontend-1", "", 1, msgspec.Raw(msgspec.msgpack.encode(command))))
    daemon_auth = PeerAuth(SECRET)
    as_is = msgspec.msgpack.encode(Signed("daemon", body, daemon_auth.control_mac("daemon", body)))
    relabelled = msgspec.msgpack.encode(Signed("frontend", body, daemon_auth.control_mac("daemon", body)))
    assert daemon_codec().decode(as_is) is None
    assert daemon_codec().decode(relabelled) is None
    genuine = msgspec.msgpack.encode(Signed("frontend", body, daemon_auth.control_mac("frontend", body)))
    assert daemon_codec().decode(genuine) == command  # the same bytes, signed as the frontend's, pass


def test_a_changed_body_breaks_its_mac():
    signed = msgspec.msgpack.decode(frontend_codec().encode(RolloutCommand("c1", "m", "/weights/v2")), type=Signed)
    stamp = msgspec.msgpack.decode(signed.body, type=Stamped)
    evil = msgspec.Raw(msgspec.msgpack.encode(RolloutCommand("c1", "m", "/weights/evil")))
    changed = msgspec.msgpack.encode(Stamped(stamp.boot, stamp.to, stamp.seq, evil))
    assert daemon_codec().decode(msgspec.msgpack.encode(Signed(signed.sender, changed, signed.mac))) is None


class _LeavesAMark:
    """Unpickling this creates the marker file: proof that nothing unpickles what arrives."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_is_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    pickled = pickle.dumps({"frontend_id": "frontend-1", "payload": _LeavesAMark(marker)})
    with pytest.raises(msgspec.DecodeError):
        daemon_codec().decode(pickled)
    # Nor is one inside a genuine envelope: the body must be the schema's MessagePack.
    signed = msgspec.msgpack.encode(Signed("frontend", pickled, PeerAuth(SECRET).control_mac("frontend", pickled)))
    with pytest.raises(msgspec.DecodeError):
        daemon_codec().decode(signed)
    assert not marker.exists()


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"not msgpack at all", b"\x93\xa8frontend\xc4\x00"])
def test_garbage_raises_for_the_caller_to_drop(garbage):
    with pytest.raises(msgspec.DecodeError):
        daemon_codec().decode(garbage)


# -- replays: the same genuine bytes again --------------------------------------------------------------------------


def test_a_message_sent_again_is_refused_as_a_replay_and_logged():
    daemon, frontend = connected()
    command = frontend.encode(RolloutCommand("c1", "m", "/weights/v2"))
    assert daemon.decode(command) == RolloutCommand("c1", "m", "/weights/v2")
    with pytest.raises(Replayed, match="sequence"):
        daemon.decode(command)
    older = frontend.encode(ScaleCommand("m", 2, 0, "ttft"))
    newer = frontend.encode(ScaleCommand("m", 1, 0, "quiet"))
    assert daemon.decode(newer) == ScaleCommand("m", 1, 0, "quiet")
    with capture_logs() as logs:  # one channel keeps its order: an older one arriving after is a replay
        assert daemon.decode_or_drop(older, structlog.get_logger()) is None
    assert [entry["event"] for entry in logs] == ["replayed_message"]


def test_an_old_tenants_update_replayed_cannot_restore_revoked_keys_at_the_frontend():
    daemon, frontend = connected()
    old_update = daemon.encode(TenantsUpdate(1, [TenantSpec("revoked", "ab" * 32)]))
    assert frontend.decode(old_update).version == 1
    assert frontend.decode(daemon.encode(TenantsUpdate(2, []))) == TenantsUpdate(2, [])
    with pytest.raises(Replayed):
        frontend.decode(old_update)


def test_after_a_frontend_restart_neither_side_takes_the_earlier_incarnations_messages():
    daemon, first = connected()
    first_scale = first.encode(ScaleCommand("m", 3, 0, "ttft"))  # captured from the first frontend
    to_first = daemon.encode(TenantsUpdate(1, [TenantSpec("revoked", "ab" * 32)]))  # captured on its way to it
    second = frontend_codec()  # restarted: a new incarnation, which starts with version 0 of the tenants
    assert daemon.decode(second.encode(ControlHello(second.boot))) == ControlHello(second.boot)
    with pytest.raises(Replayed, match="earlier frontend incarnation"):
        daemon.decode(first_scale)
    with pytest.raises(Replayed, match="addressed to"):
        second.decode(to_first)
    assert second.decode(daemon.encode(worker_set())) == worker_set()  # what is sent to it now passes


def test_the_frontend_takes_nothing_the_daemon_sent_before_its_hello():
    daemon, frontend = daemon_codec(), frontend_codec()
    with pytest.raises(Replayed, match="addressed to"):
        frontend.decode(daemon.encode(worker_set()))


# -- the daemon's end over real sockets -----------------------------------------------------------------------------


@pytest.fixture
def runtime_dir():
    # ipc paths are limited to ~107 bytes, so a short directory rather than pytest's tmp_path.
    path = Path(tempfile.mkdtemp(prefix="tokend-ctl-"))
    os.chmod(path, 0o700)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def channel(runtime_dir):
    control = ControlChannel(runtime_dir, SECRET, structlog.get_logger())
    yield control
    control.close()


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, "nothing arrived"
        time.sleep(0.01)


def _pusher(context: zmq.Context, runtime_dir: Path) -> zmq.Socket:
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"ipc://{runtime_dir}/{DAEMON_SOCKET_FILE}")
    return push


def test_the_daemon_receives_a_frontends_hello(channel, runtime_dir, zmq_context):
    assert channel.receive() == []
    push = _pusher(zmq_context, runtime_dir)
    push.send(frontend_codec().encode(ControlHello("frontend-1")))
    received = []
    _until(lambda: received.extend(channel.receive()) or received)
    assert received == [ControlHello("frontend-1")]


def test_the_daemon_sends_the_worker_set_to_the_frontend(channel, runtime_dir, zmq_context):
    pull = zmq_context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(f"ipc://{runtime_dir}/{FRONTEND_SOCKET_FILE}")
    frontend = frontend_codec()
    push = _pusher(zmq_context, runtime_dir)
    push.send(frontend.encode(ControlHello(frontend.boot)))
    _until(lambda: channel.receive())  # its hello: the daemon addresses it from now on
    channel.send(worker_set(version=9))
    assert pull.poll(int(_DEADLINE_S * 1000)), "the worker set never arrived"
    assert frontend.decode(pull.recv()) == worker_set(version=9)


def test_sending_with_no_frontend_does_not_block(channel):
    for version in range(200):  # past the send high-water mark: the rest are dropped, not waited for
        channel.send(worker_set(version))


def test_forged_and_garbage_bytes_are_dropped_and_the_genuine_messages_get_through(channel, runtime_dir, zmq_context):
    forger = frontend_codec(secrets.token_bytes(32))
    reflected = daemon_codec().encode(RolloutCommand("c0", "m", "/weights/evil"))  # the daemon's own, sent back
    push = _pusher(zmq_context, runtime_dir)
    with capture_logs() as logs:
        for data in [
            b"garbage",
            forger.encode(RolloutCommand("c1", "m", "/weights/evil")),
            frontend_codec().encode(ControlHello("frontend-1")),
            pickle.dumps({"frontend_id": "frontend-2"}),
            reflected,
            frontend_codec().encode(RolloutCommand("c2", "m", "/weights/v2")),
        ]:
            push.send(data)
        received = []
        _until(lambda: received.extend(channel.receive()) or len(received) >= 2)
    assert received == [ControlHello("frontend-1"), RolloutCommand("c2", "m", "/weights/v2")]
    assert channel.receive() == []  # the bad ones came before the last genuine one: none is left over
    events = [entry["event"] for entry in logs]
    assert events.count("dropped_bad_message") == 2 and events.count("forged_message") == 2, events
