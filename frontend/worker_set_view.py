"""The frontend's reading of the daemon's worker set: which workers new requests go to, and which rollouts run.

New requests go to the weights the model's rollout targets once a worker of them serves (after a rollback, the
older ones), else to the newest serving weights (the highest epoch); while a canary holds, to the canary's workers
for its share of requests and to the others for the rest. A request stays on the worker it started on until it
ends.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from common.lanes import DrainAction, RolloutPhase
from frontend.control_messages import RolloutStatus, WorkerSet


class _Routable(Protocol):
    epoch: int


Routable = TypeVar("Routable", bound=_Routable)


class WorkerSetView:
    def __init__(self) -> None:
        self.version = -1  # none received yet: the spec's schedulers are the whole set
        self.rollouts: dict[str, RolloutStatus] = {}
        self.drain_timeout_s = 600.0
        self.on_drain_timeout = DrainAction.ABORT

    def update(self, message: WorkerSet) -> None:
        self.version = message.version
        self.rollouts = {status.model_name: status for status in message.rollouts}
        self.drain_timeout_s = message.drain_timeout_s
        self.on_drain_timeout = DrainAction(message.on_drain_timeout)

    def is_rolling(self, model_name: str) -> bool:
        """Workers of the model are being replaced (a canary that holds is not: nothing moves)."""
        return self._phase(model_name).in_progress

    def _phase(self, model_name: str) -> RolloutPhase:
        status = self.rollouts.get(model_name)
        return RolloutPhase.NONE if status is None else RolloutPhase(status.phase)

    def route(self, model_name: str, candidates: list[Routable], draw: float) -> list[Routable]:
        """The candidates a request may go to; `draw` in [0, 1) is the request's own, so a canary's split holds
        whichever worker has room first."""
        if not candidates:
            return candidates
        status = self.rollouts.get(model_name)
        if status is not None and RolloutPhase(status.phase) is RolloutPhase.CANARY:
            canary = [c for c in candidates if c.epoch == status.epoch]
            others = [c for c in candidates if c.epoch != status.epoch]
            if canary and others:
                return canary if draw * 100 < status.canary_percent else others
            return candidates
        if status is not None:  # the rollout's target once it serves (after a rollback, the older weights)
            targeted = [c for c in candidates if c.epoch == status.epoch]
            if targeted:
                return targeted
        newest = max(c.epoch for c in candidates)
        return [c for c in candidates if c.epoch == newest]
