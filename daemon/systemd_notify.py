"""sd_notify: tells systemd READY=1 / RELOADING=1 / STOPPING=1 / WATCHDOG=1 over $NOTIFY_SOCKET (a no-op outside
systemd). RELOADING=1 then READY=1 around a SIGHUP is the protocol of Type=notify-reload (systemd 253): with it,
`systemctl reload` returns once the reload is done (or refused), not when the signal is sent."""

from __future__ import annotations

import contextlib
import os
import socket
import time


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

    def reloading(self) -> None:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        self.notify(f"RELOADING=1\nMONOTONIC_USEC={usec}\nSTATUS=reloading the configuration")

    def reloaded(self, status: str) -> None:
        """The reload is over, taken or refused: `status` says which."""
        self.notify(f"READY=1\nSTATUS={status}")

    def stopping(self) -> None:
        self.notify("STOPPING=1\nSTATUS=draining")

    def watchdog(self) -> None:
        self.notify("WATCHDOG=1")

    def status(self, text: str) -> None:
        self.notify(f"STATUS={text}")
