"""What a receiver of the IPC channels refused, counted by why: an operator alerts on it (tokend:ipc_messages_rejected)
because a peer process never sends either, so every count is a bug or someone on the host probing the sockets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

MALFORMED = "malformed"  # bytes that do not decode as one of the channel's messages
FORGED = "forged"  # a message that decodes but is not the peer's: no session, a bad seal or proof, a replay


@dataclass
class RejectedMessages:
    """Written by one receiving thread, read by another (a load report): each count only grows."""

    malformed: int = 0
    forged: int = 0
    on_count: Callable[[str], None] | None = None  # told each reason as it is counted (the frontend's metric)

    def count(self, reason: str) -> None:
        setattr(self, reason, getattr(self, reason) + 1)
        if self.on_count is not None:
            self.on_count(reason)
