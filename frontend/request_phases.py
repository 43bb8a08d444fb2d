"""RequestPhases: where one request's time went, in vLLM's phases (queue, prefill, decode), on the frontend's clock."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.ipc.messages import RequestDelta


@dataclass(slots=True)
class RequestPhases:
    admission_wait_s: float  # in the frontend's admission, until it was sent to a scheduler
    submitted_at: float  # time.monotonic() when it was sent
    scheduler_queued_s: float = 0.0  # in the scheduler's queue until its first step (the first token's delta says)
    first_token_at: float | None = None
    last_token_at: float | None = None

    def on_deltas(self, deltas: list[RequestDelta], now: float) -> None:
        """A batch of the request's deltas arrived at `now`."""
        for delta in deltas:
            if delta.queued_s is not None:
                self.scheduler_queued_s = delta.queued_s
        if any(delta.new_token_ids for delta in deltas):
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now

    @property
    def queue_s(self) -> float:
        return self.admission_wait_s + self.scheduler_queued_s

    @property
    def prefill_s(self) -> float:
        """First scheduled step to first token. The scheduler's clock is not ours: its queue is counted from our
        sending, so the hop to it (well under a millisecond on ipc) lands in prefill, which stays >= 0."""
        if self.first_token_at is None:
            return 0.0
        return max(0.0, self.first_token_at - (self.submitted_at + self.scheduler_queued_s))

    @property
    def decode_s(self) -> float:
        if self.first_token_at is None or self.last_token_at is None:
            return 0.0
        return self.last_token_at - self.first_token_at
