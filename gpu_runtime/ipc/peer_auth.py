"""The per-boot secret that proves a FrontendHello or SchedulerReady came from a process the daemon started.

The daemon writes a random secret to a 0600 file in the 0700 runtime directory before it spawns anything; every
child reads it from there (never from argv, which `ps` shows to every user). A hello or ready carries an
HMAC-SHA256 over its sender's identity keyed by the secret, so a process that can reach the ipc sockets but not
read the file cannot make a scheduler drop its requests or make the frontend take it for a restarted scheduler.

Every frame after them, both ways, is sealed (FrameSeal): the hello's fresh nonce and the ready's incarnation make
one key per connection and direction (PeerAuth.session), and each frame carries a sequence number and an HMAC over
it and the frame; a frame without a genuine seal, or with a sequence already taken, is dropped. So a process that
can reach the sockets cannot add, abort or redirect requests, nor replay frames it captured.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

SECRET_FILE = "peer-secret"  # in the runtime directory
_SECRET_BYTES = 32
# Each proof names what it vouches for, so that a hello's proof can never pass as a ready's.
_HELLO = b"tokend-frontend-hello\0"
_READY = b"tokend-scheduler-ready\0"
_CONTROL = b"tokend-control\0"  # the daemon <-> frontend control channel (frontend.control_messages)
_SESSION = b"tokend-session\0"  # a frontend <-> scheduler connection's keys, one per direction
_TP_CHALLENGE = b"tokend-tp-challenge\0"  # a tensor-parallel group's start (its own secret: gpu_runtime.tp.group)
_TP_STEP = b"tokend-tp-step\0"  # each command rank 0 broadcasts to the other ranks


def write_secret(runtime_dir: Path) -> Path:
    """Creates the boot's secret file (mode 0600 from its first byte; it must not exist yet); returns its path."""
    path = runtime_dir / SECRET_FILE
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(secrets.token_bytes(_SECRET_BYTES))
    return path


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret in the file; OSError if it cannot be read, ValueError if it is not one the daemon wrote."""
    secret = Path(path).read_bytes()
    if len(secret) != _SECRET_BYTES:
        raise ValueError(f"secret_path: {path} holds {len(secret)} bytes, not a {_SECRET_BYTES}-byte secret")
    return secret


class PeerAuth:
    """Signs this process's hellos or readies, and checks the other side's."""

    def __init__(self, secret: bytes):
        self._secret = secret

    def hello_proof(self, frontend_id: str, nonce: bytes = b"") -> bytes:
        return self._mac(_HELLO, frontend_id, nonce.hex())

    def ready_proof(self, worker_id: str, incarnation: str, kv_address: str = "") -> bytes:
        # The KV address too: the frontend follows a handover only to the address its prefill worker's ready named.
        return self._mac(_READY, worker_id, incarnation, kv_address)

    def hello_is_genuine(self, frontend_id: str, proof: bytes, nonce: bytes = b"") -> bool:
        return hmac.compare_digest(self.hello_proof(frontend_id, nonce), proof)

    def ready_is_genuine(self, worker_id: str, incarnation: str, proof: bytes, kv_address: str = "") -> bool:
        return hmac.compare_digest(self.ready_proof(worker_id, incarnation, kv_address), proof)

    def control_mac(self, sender: str, body: bytes) -> bytes:
        """Signs one control-channel message: its sender ("daemon" or "frontend") and its encoded bytes."""
        return self._mac(_CONTROL, sender, body.hex())

    def control_is_genuine(self, sender: str, body: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.control_mac(sender, body), mac)

    def session(self, frontend_id: str, nonce: bytes, worker_id: str, incarnation: str, *, receives: str) -> Session:
        """The seals of one frontend <-> scheduler connection, as the end that `receives` frames TO_SCHEDULER (the
        scheduler's) or TO_FRONTEND (the frontend's) holds them. Bound to the hello's nonce, new at every
        connection, and to the scheduler's incarnation, new at every process start: a frame of any other
        connection fails its MAC here."""
        sends = TO_FRONTEND if receives == TO_SCHEDULER else TO_SCHEDULER
        keys = {way: self._mac(_SESSION, way, frontend_id, nonce.hex(), worker_id, incarnation)
                for way in (receives, sends)}  # fmt: skip
        return Session(incarnation, receive=FrameSeal(keys[receives]), send=FrameSeal(keys[sends]))

    def _mac(self, purpose: bytes, *parts: str) -> bytes:
        # Each part is length-prefixed: ("ab", "c") and ("a", "bc") must not sign the same bytes.
        message = purpose + b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    # -- tensor parallelism (gpu_runtime.tp.group_auth): gloo's listeners accept any local user --------------------

    def tp_answer(self, nonces: bytes, rank: int, world_size: int) -> bytes:
        """Rank `rank`'s answer to a group's challenge (every rank's nonce, in rank order)."""
        return self._mac(_TP_CHALLENGE, nonces.hex(), str(rank), str(world_size))

    def tp_step_mac(self, sequence: int, payload: bytes) -> bytes:
        """Signs rank 0's `sequence`-th broadcast (a StepPlan or a stop); the payload taken as bytes, not hex:
        every step pays for it."""
        message = _TP_STEP + sequence.to_bytes(8, "big") + payload
        return hmac.new(self._secret, message, hashlib.sha256).digest()


# -- frames after the hello ------------------------------------------------------------------------------------

TO_SCHEDULER = "to_scheduler"  # the two directions of a connection (and the channels forged_message logs name)
TO_FRONTEND = "to_frontend"
_SEQ_BYTES = 8
SEAL_BYTES = _SEQ_BYTES + hashlib.sha256().digest_size  # what FrameSeal.seal returns: the sequence, then the MAC


class FrameSeal:
    """One direction of one connection: its sender seals each frame with the next sequence number and an HMAC-SHA256
    over that number and the frame; its receiver takes a frame only with a genuine MAC and a sequence above the
    last one it took (gaps are fine: a sender may drop a frame its full queue refused). One thread uses it."""

    def __init__(self, key: bytes):
        self._key = key
        self._sent = 0
        self._taken = 0

    def seal(self, frame: bytes) -> bytes:
        self._sent += 1
        seq = self._sent.to_bytes(_SEQ_BYTES, "big")
        return seq + hmac.digest(self._key, seq + frame, "sha256")

    def check(self, frame: bytes, seal: bytes) -> str | None:
        """None when the frame is genuine and new (its sequence is then the last taken); else why it is not."""
        if len(seal) != SEAL_BYTES:
            return "malformed_seal"
        seq = seal[:_SEQ_BYTES]
        if not hmac.compare_digest(hmac.digest(self._key, seq + frame, "sha256"), seal[_SEQ_BYTES:]):
            return "bad_mac"
        number = int.from_bytes(seq, "big")
        if number <= self._taken:
            return "replayed"
        self._taken = number
        return None


@dataclass(frozen=True, slots=True)
class Session:
    """One connection as one of its ends holds it: the scheduler incarnation it is bound to, and its two seals."""

    incarnation: str
    receive: FrameSeal
    send: FrameSeal
