"""A stand-in for systemd's notification socket: a daemon started with `env=socket.env` tells it READY=1,
RELOADING=1, STOPPING=1 as it would tell systemd, and a test waits on those events instead of on log lines."""

from __future__ import annotations

import contextlib
import socket
import tempfile
import time
from pathlib import Path


class NotifySocket:
    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="tokend-notify-")
        self.path = str(Path(self._directory.name) / "notify.sock")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.path)
        self.messages: list[str] = []  # every datagram so far, in order

    @property
    def env(self) -> dict[str, str]:
        return {"NOTIFY_SOCKET": self.path}

    def wait_for(self, line: str, after: int = 0, timeout: float = 60.0) -> int:
        """The index in `messages` of the first one from `after` on with `line` (e.g. "READY=1") among its lines;
        raises TimeoutError, listing what came, if none does in time."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(after, len(self.messages)):
                if line in self.messages[index].splitlines():
                    return index
            after = max(after, len(self.messages))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {line!r} from the daemon in {timeout} s; it sent {self.messages}")
            self._socket.settimeout(left)
            with contextlib.suppress(TimeoutError):
                self.messages.append(self._socket.recv(4096).decode())

    def close(self) -> None:
        self._socket.close()
        self._directory.cleanup()

    def __enter__(self) -> NotifySocket:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
