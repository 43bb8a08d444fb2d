"""What a model's rollout does next: a pure function of its target and its workers, so it is tested as it is.

The supervisor asks once per tick and carries out at most one action, then asks again once that action's effect
is visible (a started worker serves, a drained one retired). Both strategies end with `target_count` workers on
the target epoch and none on any other:

- surge (maxSurge = the spare groups, maxUnavailable 0): start a new worker on a spare group; once one serves,
  every old worker drains at once (new requests go to the newest serving weights anyway, so an old worker left
  "serving" would only sit idle); each old group that retires is spare again for the next new worker.
- in-place (maxUnavailable 1): drain one old worker, start the new weights on its group once it retired, and only
  then the next. Once a new worker serves, the remaining old ones drain as well, one at a time.

A canary (1..99 %) stops at its share of new workers, at least one, with the old ones still serving: the frontend
sends that share of new requests to the new weights until a second rollout command lifts the canary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from frontend.control_messages import RolloutStrategy, WorkerState


@dataclass(frozen=True, slots=True)
class PlannedWorker:
    """What the plan needs to know of one worker."""

    worker_id: str
    epoch: int
    state: WorkerState
    slot: int
    standby: bool = False  # to wait unrouted once warm (daemon.scaling_plan)


@dataclass(frozen=True, slots=True)
class Target:
    epoch: int
    strategy: RolloutStrategy
    target_count: int
    canary_percent: int = 0  # 0 (or 100): no canary

    @property
    def is_canary(self) -> bool:
        return 0 < self.canary_percent < 100

    @property
    def count_wanted(self) -> int:
        """New workers this step of the rollout wants: all of them, or a canary's share (at least one)."""
        if not self.is_canary:
            return self.target_count
        return max(1, min(self.target_count, math.ceil(self.target_count * self.canary_percent / 100)))


@dataclass(frozen=True, slots=True)
class StartWorker:
    slot: int
    standby: bool = False  # once warm it waits unrouted, to be promoted (daemon.scaling_plan)


@dataclass(frozen=True, slots=True)
class PromoteWorkers:
    """Standby workers that serve from now on: a routing flip, the weights are loaded and warm."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DemoteWorkers:
    """Serving workers that wait as standbys from now on: routed nothing new, their streams finish where they are,
    and a later scale-up promotes them again without a warm-up (daemon.scaling_plan)."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DrainWorkers:
    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Workers of other weights that serve nobody yet (loading, or crashed and waiting to restart): a rollback
    overtook them, or they crash-loop while a rollout replaces them. Nothing runs there: they stop now."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str


@dataclass(frozen=True, slots=True)
class Done:
    pass


@dataclass(frozen=True, slots=True)
class Stuck:
    reason: str


Action = StartWorker | PromoteWorkers | DemoteWorkers | DrainWorkers | StopWorkers | Wait | Done | Stuck
_ALIVE = (WorkerState.STARTING, WorkerState.STANDBY, WorkerState.SERVING, WorkerState.DRAINING, WorkerState.FAILED)


def next_action(target: Target, workers: list[PlannedWorker], spare_slots: list[int]) -> Action:
    """The one thing to do now for the model whose workers these are."""
    alive = [w for w in workers if w.state in _ALIVE]
    new = [w for w in alive if w.epoch == target.epoch]
    old = [w for w in alive if w.epoch != target.epoch]
    # A standby of other weights is stopped too: the scaling plan starts one on the new weights afterwards.
    old_unready = [w for w in old if w.state in (WorkerState.STARTING, WorkerState.FAILED, WorkerState.STANDBY)]
    if old_unready:
        return StopWorkers(tuple(w.worker_id for w in old_unready))
    if any(w.state in (WorkerState.STARTING, WorkerState.FAILED) for w in new):
        return Wait("a new worker is starting")
    new_serving = [w for w in new if w.state == WorkerState.SERVING]
    old_serving = [w for w in old if w.state == WorkerState.SERVING]
    old_draining = [w for w in old if w.state == WorkerState.DRAINING]
    if target.strategy == RolloutStrategy.SURGE:
        return _surge(target, new, new_serving, old_serving, old_draining, spare_slots)
    return _in_place(target, new, new_serving, old_serving, old_draining, spare_slots)


def _surge(target, new, new_serving, old_serving, old_draining, spare_slots) -> Action:
    if new_serving and old_serving and not target.is_canary:
        return DrainWorkers(tuple(w.worker_id for w in old_serving))
    if len(new) < target.count_wanted:
        if spare_slots:
            return StartWorker(spare_slots[0])
        if old_draining:
            return Wait("waiting for an old worker to drain and free its group")
        return Stuck("no spare group to start a new worker on (spare_devices)")
    return _settled(target, new_serving, old_serving, old_draining)


def _in_place(target, new, new_serving, old_serving, old_draining, spare_slots) -> Action:
    if old_draining:
        return Wait("waiting for an old worker to drain")
    if len(new) < target.count_wanted:
        if spare_slots:
            return StartWorker(spare_slots[0])
        if old_serving:
            return DrainWorkers((old_serving[0].worker_id,))
        return Stuck("no group to restart on the new weights")
    if new_serving and old_serving and not target.is_canary:
        return DrainWorkers((old_serving[0].worker_id,))
    return _settled(target, new_serving, old_serving, old_draining)


def _settled(target, new_serving, old_serving, old_draining) -> Action:
    if len(new_serving) < target.count_wanted:
        return Wait("a new worker is not serving yet")
    if old_draining or (old_serving and not target.is_canary):
        return Wait("waiting for old workers to drain")
    return Done()
