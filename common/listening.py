"""How a child tells the daemon that its listeners are bound: a marker file in the daemon's private runtime directory.

A health probe alone cannot say so: with our port held by another server, the probe reaches that server. Only the
process that bound the port can say it did, and only the daemon (and its children) can write in that directory.
"""

from __future__ import annotations

from pathlib import Path


def mark_listening(path: str) -> None:
    """Called by a child once every listener it owns is bound; "" (a process run alone) marks nothing."""
    if path:
        Path(path).touch(mode=0o600)
