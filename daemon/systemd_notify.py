"""sd_notify: tells systemd READY=1 / STOPPING=1 / WATCHDOG=1 over $NOTIFY_SOCKET (a no-op outside systemd)."""

from __future__ import annotations

import contextlib
import os
import socket


class SystemdNotifier:
    def __init__(self) -> None:
        address = os.environ.get("NOTIFY_SOCKET")
        if address and address.startswith("@"):  # an abstract socket name
            address = "\0" + address[1:]
        self._address = address
        usec = os.environ.get("WATCHDOG_USEC")
        # Ping at half the interval systemd waits, as sd_watchdog_enabled(3) advises.
        self.watchdog_interval_s = int(usec) / 2e6 if usec and usec.isdigit() else None

    def notify(self, state: str) -> None:
        if not self._address:
            return
        # OSError: systemd went away; there is nobody to tell.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.sendto(state.encode(), self._address)

    def ready(self) -> None:
        self.notify("READY=1\nSTATUS=serving")

    def stopping(self) -> None:
        self.notify("STOPPING=1\nSTATUS=draining")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")
