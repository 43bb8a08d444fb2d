"""The control channel between the daemon (its supervisor) and the frontend, as msgspec Structs on MessagePack.

The supervisor owns the worker set (which scheduler processes exist, on which weights, in which state); the
frontend routes requests by it. The supervisor sends the whole set whenever it changes, and again whenever a
frontend says hello, so a restarted frontend is never out of date. A worker the set calls draining is told so by
the frontend itself, on the connection its requests travel, so no request can overtake it. Operators' rollout
commands reach the frontend (Admin.Rollout) and go on to the supervisor, which answers each one.

Each side binds a PULL socket in the daemon's private runtime directory and PUSHes to the other's. Every message
travels in a Signed envelope whose MAC (the per-boot secret, gpu_runtime.ipc.peer_auth) names its sender, so
bytes from anything but the daemon or its frontend are dropped. No pickle: decoding checks the schema.

Signed is not enough against a replay (the same genuine bytes sent again: an old TenantsUpdate would restore
revoked keys), so what the MAC covers is Stamped: the sender's incarnation (a random id per process), the
incarnation it is addressed to, and a sequence number that rises with every message. A receiver takes a message
only from its peer's latest incarnation, with a sequence above the last it took, and (the frontend) addressed to
itself; everything else is logged and dropped. A daemon's boot has its own secret, so nothing crosses boots; a
restarted frontend is a new incarnation, its predecessor's messages are refused from then on, and the daemon
addresses it by the id of its hello, so nothing sent to the predecessor passes at the new one either.
"""

from __future__ import annotations

import uuid

import msgspec

from common.lanes import DrainAction, Pool, Role, RolloutPhase, RolloutStrategy, WorkerState
from frontend.spec import TenantSpec
from gpu_runtime.ipc.peer_auth import PeerAuth

DAEMON_SOCKET_FILE = "daemon-control.ipc"  # the supervisor binds it; the frontend pushes here
FRONTEND_SOCKET_FILE = "frontend-control.ipc"  # the frontend binds it; the supervisor pushes here


class WorkerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str  # unique for the daemon's life: "<model>/<group>" for the first, "<model>/<group>@<epoch>" after
    model_name: str
    group: str
    devices: str  # the group as configured ("cpu", "cuda:1")
    input_address: str  # ipc:// the worker binds
    epoch: int  # the model's rollout number this worker's weights belong to; new requests go to the highest serving
    path: str  # the weights it loads (its generation hash comes in its SchedulerReady)
    state: WorkerState
    role: Role = Role.MIXED
    pid: int = 0
    warmup_seconds: float = 0.0  # from its start to its loop; 0 until it got there
    standby: bool = False  # started as a pre-warmed standby: once warm it waits unrouted until promoted


class RolloutStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's latest rollout, as Admin.GetRollout shows it."""

    model_name: str
    phase: RolloutPhase
    epoch: int
    path: str
    previous_path: str
    strategy: RolloutStrategy
    canary_percent: int
    events: list[str] = []  # the latest supervisor actions, oldest first
    error: str = ""  # why it failed (RolloutPhase.FAILED)


class WorkerSet(msgspec.Struct, frozen=True, tag="worker_set", forbid_unknown_fields=True):
    version: int  # increases with every change
    workers: list[WorkerInfo]
    rollouts: list[RolloutStatus]
    drain_timeout_s: float  # a draining worker's streams get this long before on_drain_timeout applies
    on_drain_timeout: DrainAction


class CommandResult(msgspec.Struct, frozen=True, tag="result", forbid_unknown_fields=True):
    command_id: str
    error: str = ""  # "" = accepted; else the reason, naming the field
    code: str = ""  # the gRPC status name for the error: INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND
    rollout: RolloutStatus | None = None


class TenantsUpdate(msgspec.Struct, frozen=True, tag="tenants", forbid_unknown_fields=True):
    """SIGHUP reloaded the tenants: the frontend authenticates and limits by these from now on, if `version` is
    above the one it has (the configuration's own, at start, is 0), and says so with a TenantsApplied."""

    version: int  # increases with every reload of this daemon's boot
    tenants: list[TenantSpec]


ToFrontend = WorkerSet | CommandResult | TenantsUpdate


class ControlHello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """A frontend (re)started: the supervisor answers with the current WorkerSet (and tenants)."""

    frontend_id: str


class RolloutCommand(msgspec.Struct, frozen=True, tag="rollout", forbid_unknown_fields=True):
    command_id: str
    model_name: str
    path: str  # "" with rollback
    # An operator's text, checked by the daemon so that a bad one is refused naming the field: a RolloutStrategy
    # value, or "" = surge when spare groups allow it, else in-place.
    strategy: str = ""
    canary_percent: int = 0  # 0 or 100: all new requests to the new weights; 1..99: that share, held there
    rollback: bool = False  # back to the weights before the latest rollout


class ScaleCommand(msgspec.Struct, frozen=True, tag="scale", forbid_unknown_fields=True):
    """The autoscaler's decision for one pool of a model: this many serving workers and pre-warmed standbys."""

    model_name: str
    serving: int
    standby: int
    reason: str
    pool: Pool = Pool.ROUTED


class TenantsApplied(msgspec.Struct, frozen=True, tag="tenants_applied", forbid_unknown_fields=True):
    """The frontend authenticates by this version of the tenants: the daemon stops sending it."""

    version: int


class LiveLinks(msgspec.Struct, frozen=True, tag="live_links", forbid_unknown_fields=True):
    """The workers this frontend has a live link to (their ready taken, their reports arriving), sent when the set
    changes and with every WorkerSet taken. A rollout drains old workers only once a new one is in it: the daemon
    marks a worker serving on its heartbeat, which can come before this frontend could route to it."""

    worker_ids: list[str]


ToDaemon = ControlHello | RolloutCommand | ScaleCommand | TenantsApplied | LiveLinks


class Signed(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    sender: str
    body: bytes
    mac: bytes


class Stamped(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What a Signed envelope's MAC covers: who sent it (which incarnation), to whom, in which place, and the
    message itself (its MessagePack, decoded by the receiver's schema)."""

    boot: str  # the sender's incarnation: a random id per process
    to: str  # the receiver's incarnation, as the sender last heard from it ("" before it has)
    seq: int  # rises by one with every message this incarnation sends
    message: msgspec.Raw


class Replayed(Exception):
    """A genuine message out of its place: sent again, to an earlier incarnation, or by one."""


class ControlCodec:
    """Encodes, stamps and signs what one side sends; checks and decodes what it receives (None for anything
    forged, Replayed for a genuine message that is not new). `addressed_only`: take only messages addressed to this
    incarnation (the frontend, which always speaks first, with a hello)."""

    def __init__(self, auth: PeerAuth, sender: str, receives: type, boot: str | None = None,
                 addressed_only: bool = False):  # fmt: skip
        self._auth = auth
        self._sender = sender
        self._peer = "frontend" if sender == "daemon" else "daemon"
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)
        self._envelopes = msgspec.msgpack.Decoder(Signed)
        self._stamps = msgspec.msgpack.Decoder(Stamped)
        self.boot = boot or uuid.uuid4().hex
        self._addressed_only = addressed_only
        self._sent = 0
        self.peer_boot = ""  # the peer incarnation messages are taken from now, and sent to
        self._peer_seq = 0  # the last sequence taken from it
        self._retired: set[str] = set()  # earlier incarnations of the peer: never taken again

    def encode(self, message: msgspec.Struct) -> bytes:
        self._sent += 1
        stamp = Stamped(self.boot, self.peer_boot, self._sent, msgspec.Raw(self._encoder.encode(message)))
        body = self._encoder.encode(stamp)
        return self._encoder.encode(Signed(self._sender, body, self._auth.control_mac(self._sender, body)))

    def decode(self, data: bytes):
        """The message; None when the MAC is not the peer's; Replayed when it is genuine but not new. Raises (any
        other Exception) for bytes that are not one."""
        envelope = self._envelopes.decode(data)
        if envelope.sender != self._peer or not self._auth.control_is_genuine(self._peer, envelope.body, envelope.mac):
            return None
        stamp = self._stamps.decode(envelope.body)
        message = self._decoder.decode(stamp.message)
        self._take(stamp)
        return message

    def _take(self, stamp: Stamped) -> None:
        """Moves on to the stamp's place, or raises Replayed: the checks that make a captured message worthless."""
        if stamp.to != self.boot and (stamp.to or self._addressed_only):
            raise Replayed(f"addressed to incarnation {stamp.to!r}, not this one")
        if stamp.boot in self._retired:
            raise Replayed(f"from an earlier {self._peer} incarnation {stamp.boot!r}")
        if stamp.boot == self.peer_boot and stamp.seq <= self._peer_seq:
            raise Replayed(f"sequence {stamp.seq} is not above {self._peer_seq}, the last taken")
        if stamp.boot != self.peer_boot:  # a restarted peer: its predecessor is never heard again
            if self.peer_boot:
                self._retired.add(self.peer_boot)
            self.peer_boot = stamp.boot
        self._peer_seq = stamp.seq

    def decode_or_drop(self, data: bytes, log):
        """The message, or None for bytes that are not a genuine, new one (logged: bad bytes, a forged MAC, or a
        replay)."""
        try:
            message = self.decode(data)
        except Replayed as replay:
            log.warning("replayed_message", channel="control", sender=self._peer, reason=str(replay))
            return None
        except Exception as error:  # see gpu_runtime.ipc.messages.Codec.decode
            log.warning("dropped_bad_message", channel="control", bytes=len(data), error=str(error)[:200])
            return None
        if message is None:
            log.warning("forged_message", channel="control")
        return message
