"""The control channel between the daemon (its supervisor) and the frontend, as msgspec Structs on MessagePack.

The supervisor owns the worker set (which scheduler processes exist, on which weights, in which state); the
frontend routes requests by it. The supervisor sends the whole set whenever it changes, and again whenever a
frontend says hello, so a restarted frontend is never out of date. A worker the set calls draining is told so by
the frontend itself, on the connection its requests travel, so no request can overtake it. Operators' rollout
commands reach the frontend (Admin.Rollout) and go on to the supervisor, which answers each one.

Each side binds a PULL socket in the daemon's private runtime directory and PUSHes to the other's. Every message
travels in a Signed envelope whose MAC (the per-boot secret, gpu_runtime.ipc.peer_auth) names its sender, so
bytes from anything but the daemon or its frontend are dropped. No pickle: decoding checks the schema.
"""

from __future__ import annotations

import enum

import msgspec

from frontend.spec import TenantSpec
from gpu_runtime.ipc.peer_auth import PeerAuth

DAEMON_SOCKET_FILE = "daemon-control.ipc"  # the supervisor binds it; the frontend pushes here
FRONTEND_SOCKET_FILE = "frontend-control.ipc"  # the frontend binds it; the supervisor pushes here


class WorkerState(enum.StrEnum):
    """A worker's life (../shared/DESIGN.md, "Workers"): starting -> serving -> draining -> retired, or failed.

    standby: loaded and warm but not routed (a canary held back, or pre-warmed capacity)."""

    STARTING = "starting"  # the process is loading its model and warming up
    STANDBY = "standby"
    SERVING = "serving"  # takes new requests (if its generation is the one new requests go to)
    DRAINING = "draining"  # takes no new requests; finishes its in-flight ones, then exits 0
    RETIRED = "retired"
    FAILED = "failed"  # crashed; restarted with backoff


class RolloutStrategy(enum.StrEnum):
    SURGE = "surge"  # new workers on spare groups first, then the old ones drain (maxUnavailable 0)
    IN_PLACE = "in-place"  # one group at a time drains and restarts on the new weights (maxUnavailable 1)


class DrainTimeoutAction(enum.StrEnum):
    ABORT = "abort"  # a stream still running at the drain timeout ends with finish_reason "abort"
    MIGRATE = "migrate"  # it is re-submitted (prompt + tokens so far) to a serving worker and goes on there


class WorkerInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str  # unique for the daemon's life: "<model>/<group>" for the first, "<model>/<group>@<epoch>" after
    model_name: str
    group: str
    devices: str  # the group as configured ("cpu", "cuda:1")
    input_address: str  # ipc:// the worker binds
    epoch: int  # the model's rollout number this worker's weights belong to; new requests go to the highest serving
    path: str  # the weights it loads (its generation hash comes in its SchedulerReady)
    state: WorkerState
    role: str = "mixed"
    pid: int = 0
    warmup_seconds: float = 0.0  # from its start to its loop; 0 until it got there
    standby: bool = False  # started as a pre-warmed standby: once warm it waits unrouted until promoted


class RolloutStatus(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One model's latest rollout, as Admin.GetRollout shows it."""

    model_name: str
    # "none" (never rolled out), "rolling", "canary" (held at canary_percent), "done", "rolling-back" (its new
    # weights failed to serve: back to the earlier ones), "failed" (back on the earlier ones)
    phase: str
    epoch: int
    path: str
    previous_path: str
    strategy: RolloutStrategy
    canary_percent: int
    events: list[str] = []  # the latest supervisor actions, oldest first
    error: str = ""  # why it failed (phase "failed")


class WorkerSet(msgspec.Struct, frozen=True, tag="worker_set", forbid_unknown_fields=True):
    version: int  # increases with every change
    workers: list[WorkerInfo]
    rollouts: list[RolloutStatus]
    drain_timeout_s: float  # a draining worker's streams get this long before on_drain_timeout applies
    on_drain_timeout: DrainTimeoutAction


class CommandResult(msgspec.Struct, frozen=True, tag="result", forbid_unknown_fields=True):
    command_id: str
    error: str = ""  # "" = accepted; else the reason, naming the field
    code: str = ""  # the gRPC status name for the error: INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND
    rollout: RolloutStatus | None = None


class TenantsUpdate(msgspec.Struct, frozen=True, tag="tenants", forbid_unknown_fields=True):
    """SIGHUP reloaded the tenants: the frontend authenticates and limits by these from now on."""

    tenants: list[TenantSpec]


ToFrontend = WorkerSet | CommandResult | TenantsUpdate


class ControlHello(msgspec.Struct, frozen=True, tag="hello", forbid_unknown_fields=True):
    """A frontend (re)started: the supervisor answers with the current WorkerSet (and tenants)."""

    frontend_id: str


class RolloutCommand(msgspec.Struct, frozen=True, tag="rollout", forbid_unknown_fields=True):
    command_id: str
    model_name: str
    path: str  # "" with rollback
    strategy: str = ""  # "" = surge when spare groups allow it, else in-place
    canary_percent: int = 0  # 0 or 100: all new requests to the new weights; 1..99: that share, held there
    rollback: bool = False  # back to the weights before the latest rollout


class ScaleCommand(msgspec.Struct, frozen=True, tag="scale", forbid_unknown_fields=True):
    """The autoscaler's decision for one pool of a model: this many serving workers and pre-warmed standbys."""

    model_name: str
    serving: int
    standby: int
    reason: str
    # The pool: "prefill" (its prefill workers), or "decode"/"mixed" (the workers requests are routed to).
    role: str = "mixed"


ToDaemon = ControlHello | RolloutCommand | ScaleCommand


class Signed(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    sender: str
    body: bytes
    mac: bytes


class ControlCodec:
    """Encodes and signs what one side sends; checks and decodes what it receives (None for anything forged)."""

    def __init__(self, auth: PeerAuth, sender: str, receives: type):
        self._auth = auth
        self._sender = sender
        self._peer = "frontend" if sender == "daemon" else "daemon"
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(receives)
        self._envelopes = msgspec.msgpack.Decoder(Signed)

    def encode(self, message: msgspec.Struct) -> bytes:
        body = self._encoder.encode(message)
        return self._encoder.encode(Signed(self._sender, body, self._auth.control_mac(self._sender, body)))

    def decode(self, data: bytes):
        """The message; None when the MAC is not the peer's. Raises (any Exception) for bytes that are not one."""
        envelope = self._envelopes.decode(data)
        if envelope.sender != self._peer or not self._auth.control_is_genuine(self._peer, envelope.body, envelope.mac):
            return None
        return self._decoder.decode(envelope.body)

    def decode_or_drop(self, data: bytes, log):
        """The message, or None for bytes that are not a genuine one (logged: bad bytes, or a forged MAC)."""
        try:
            message = self.decode(data)
        except Exception as error:  # see gpu_runtime.ipc.messages.Codec.decode
            log.warning("dropped_bad_message", channel="control", bytes=len(data), error=str(error)[:200])
            return None
        if message is None:
            log.warning("forged_message", channel="control")
        return message
