"""The per-boot secret that proves a FrontendHello or SchedulerReady came from a process the daemon started.

The daemon writes a random secret to a 0600 file in the 0700 runtime directory before it spawns anything; every
child reads it from there (never from argv, which `ps` shows to every user). A hello or ready carries an
HMAC-SHA256 over its sender's identity keyed by the secret, so a process that can reach the ipc sockets but not
read the file cannot make a scheduler drop its requests or make the frontend take it for a restarted scheduler.

The other messages need no proof of their own: requests reach a scheduler only after a genuine hello (see
SchedulerLoop), and the frontend takes outputs and load reports only with the incarnation of a genuine ready,
a random id that only the frontend and that scheduler ever see.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

SECRET_FILE = "peer-secret"  # in the runtime directory
_SECRET_BYTES = 32
# Each proof names what it vouches for, so that a hello's proof can never pass as a ready's.
_HELLO = b"tokend-frontend-hello\0"
_READY = b"tokend-scheduler-ready\0"
_CONTROL = b"tokend-control\0"  # the daemon <-> frontend control channel (frontend.control_messages)


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

    def hello_proof(self, frontend_id: str) -> bytes:
        return self._mac(_HELLO, frontend_id)

    def ready_proof(self, worker_id: str, incarnation: str) -> bytes:
        return self._mac(_READY, worker_id, incarnation)

    def hello_is_genuine(self, frontend_id: str, proof: bytes) -> bool:
        return hmac.compare_digest(self.hello_proof(frontend_id), proof)

    def ready_is_genuine(self, worker_id: str, incarnation: str, proof: bytes) -> bool:
        return hmac.compare_digest(self.ready_proof(worker_id, incarnation), proof)

    def control_mac(self, sender: str, body: bytes) -> bytes:
        """Signs one control-channel message: its sender ("daemon" or "frontend") and its encoded bytes."""
        return self._mac(_CONTROL, sender, body.hex())

    def control_is_genuine(self, sender: str, body: bytes, mac: bytes) -> bool:
        return hmac.compare_digest(self.control_mac(sender, body), mac)

    def _mac(self, purpose: bytes, *parts: str) -> bytes:
        # Each part is length-prefixed: ("ab", "c") and ("a", "bc") must not sign the same bytes.
        message = purpose + b"".join(len(p.encode()).to_bytes(4, "big") + p.encode() for p in parts)
        return hmac.new(self._secret, message, hashlib.sha256).digest()
