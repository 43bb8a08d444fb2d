"""The local admin credential: a random token the daemon writes at each boot to a 0600 file in its state directory.

With no tenants configured, Admin's mutating RPCs (Drain, Rollout) need it, so that not every local user can drain
the daemon or point it at weights of their choosing. The CLI reads the file (`tokend rollout --state-dir`); the
frontend is given only the token's SHA-256, never the token, and compares in constant time.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

ADMIN_TOKEN_FILE = "admin-token"


def write_admin_token(state_dir: str | os.PathLike) -> str:
    """A new token for this boot, in <state_dir>/admin-token (mode 0600 from its first byte, replacing the last
    boot's in one rename); returns its hex SHA-256."""
    token = secrets.token_urlsafe(32)
    path = Path(state_dir) / ADMIN_TOKEN_FILE
    staged = path.with_name(f".{ADMIN_TOKEN_FILE}.{os.getpid()}")
    staged.unlink(missing_ok=True)
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(token + "\n")
    os.replace(staged, path)
    return hashlib.sha256(token.encode()).hexdigest()


def read_admin_token(state_dir: str | os.PathLike) -> str:
    """The running daemon's token; "" when there is none to read (no daemon here, or not this user's)."""
    try:
        return (Path(state_dir) / ADMIN_TOKEN_FILE).read_text().strip()
    except OSError:
        return ""
