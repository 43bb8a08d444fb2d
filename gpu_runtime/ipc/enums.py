"""The enums every tokend process shares: a request's priority class and why its generation ended."""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """Lower is more urgent: interactive requests are admitted first and preempted last.

    On the wire (IPC, ledger rows, config) a class is its `label`; the public API has its own proto enum,
    converted once where a request is validated.
    """

    INTERACTIVE = 0
    BATCH = 1

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> Priority:
        """ValueError for anything but "interactive" or "batch"."""
        try:
            return cls[label.upper()]
        except KeyError:
            raise ValueError(f"must be interactive|batch, got {label!r}") from None


class FinishReason(enum.StrEnum):
    """Why a request's generation ended; its value is the API's `finish_reason` string."""

    STOP = "stop"  # a stop token, eos, or (decided in the frontend) a stop string
    LENGTH = "length"  # max_tokens, or the model's context
    ABORT = "abort"  # cancelled by the client, a deadline, or the frontend
    ERROR = "error"  # refused by the scheduler; RequestDelta.error says why
