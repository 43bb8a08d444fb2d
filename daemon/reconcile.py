"""What one pool of a model's workers does next: a pure function of its desired target, its actual workers and now.

The desired set is a PoolTarget per model and pool (Pool.ROUTED, Pool.PREFILL), written by three writers: a rollout
(the epoch, strategy and canary share), the autoscaler (the serving and standby counts) and, implicitly, crash
restart (a target slot whose worker failed is restarted once its back-off is over). The supervisor asks once per
tick and carries out at most one action, then asks again once that action's effect is visible (a started worker
serves, a drained one retired). A pool holding workers of other weights is rolled onto the target's weights; a pool
whose workers are all on them is scaled to the counts.

Rolling (both strategies end with `serving` workers on the target epoch and none on any other):
- surge (maxSurge = the spare groups, maxUnavailable 0): start a new worker on a spare group; once one serves,
  every old worker drains at once (new requests go to the newest serving weights anyway, so an old worker left
  "serving" would only sit idle); each old group that retires is spare again for the next new worker.
- in-place (maxUnavailable 1): drain one old worker, start the new weights on its group once it retired, and only
  then the next. Once a new worker serves, the remaining old ones drain as well, one at a time.
A new worker serves once the daemon saw its heartbeat and the frontend has a live link to it
(`PlannedWorker.linked`): until the frontend can route to it, no old worker drains for it.
A canary (1..99 %) stops at its share of new workers, at least one, with the old ones still serving: the frontend
sends that share of new requests to the new weights until a second rollout command lifts the canary.

Scaling: up promotes a standby first (a routing flip: the worker is loaded and warm), then a standby still loading
(it serves once warm), and only then starts a worker that must load; a standby used up is replaced behind it.
Standbys start side by side, each on its own group, so that a reserve for the peak is warm one warm-up later rather
than one warm-up per worker. Down demotes the newest serving worker to a standby while fewer standbys are wanted
than there are (the flip back: its streams finish there, and the warm-up it already paid for is kept), and otherwise
drains it. A standby no longer wanted drains too: a demoted one may still be finishing streams. Nothing is decided
while a worker waits to restart, and nothing goes down while a worker that should serve is still loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.lanes import RolloutStrategy, WorkerState


@dataclass(frozen=True, slots=True)
class PoolTarget:
    """One pool's desired workers: how many serve and wait as standbys, on which weights, got there how."""

    epoch: int  # the weights: 0 is the configuration's own, each rollout to new weights the next
    serving: int
    standby: int = 0  # pre-warmed workers kept beside the serving ones (min_standby, the peak's reserve)
    strategy: RolloutStrategy = RolloutStrategy.SURGE
    canary_percent: int = 0  # 0 (or 100): no canary

    @property
    def is_canary(self) -> bool:
        return 0 < self.canary_percent < 100

    @property
    def count_wanted(self) -> int:
        """New workers a rollout to this target wants: all of them, or a canary's share (at least one)."""
        if not self.is_canary:
            return self.serving
        return max(1, min(self.serving, math.ceil(self.serving * self.canary_percent / 100)))


@dataclass(frozen=True, slots=True)
class PlannedWorker:
    """What the reconciler needs to know of one worker."""

    worker_id: str
    epoch: int
    state: WorkerState
    slot: int
    standby: bool = False  # to wait unrouted once warm
    restart_at: float | None = None  # a failed worker's end of back-off
    # The frontend has a live link to it (frontend.control_messages.LiveLinks): serving, it takes new requests.
    linked: bool = True


@dataclass(frozen=True, slots=True)
class PoolActual:
    """One pool's workers and the free groups of its role a new one may take."""

    workers: tuple[PlannedWorker, ...]
    own_slots: tuple[int, ...] = ()  # free groups the model held (its configured ones, spares it used)
    spare_slots: tuple[int, ...] = ()  # free spare groups never used: a surge (and scaling) may take them too
    free_slots: tuple[int, ...] = field(init=False)  # both, in slot order

    def __post_init__(self) -> None:
        object.__setattr__(self, "free_slots", tuple(sorted(self.own_slots + self.spare_slots)))


@dataclass(frozen=True, slots=True)
class StartWorker:
    slot: int
    standby: bool = False  # once warm it waits unrouted, to be promoted


@dataclass(frozen=True, slots=True)
class RestartWorkers:
    """Failed workers whose back-off is over: started again on their groups, on their own weights."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PromoteWorkers:
    """Standby workers that serve from now on: a routing flip, the weights are loaded and warm."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DemoteWorkers:
    """Serving workers that wait as standbys from now on: routed nothing new, their streams finish where they are,
    and a later scale-up promotes them again without a warm-up."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DrainWorkers:
    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class StopWorkers:
    """Workers that serve nobody yet (loading, or crashed and waiting to restart): of other weights, a rollback
    overtook them, or they crash-loop while a rollout replaces them; or a standby still loading that the reserve no
    longer wants. Nothing runs there: they stop now."""

    worker_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str


@dataclass(frozen=True, slots=True)
class Done:
    pass


@dataclass(frozen=True, slots=True)
class Stuck:
    """The target cannot be reached (no group to start on): the rollout writer goes back to the weights before."""

    reason: str


Action = (
    StartWorker | RestartWorkers | PromoteWorkers | DemoteWorkers | DrainWorkers | StopWorkers | Wait | Done | Stuck
)
_ALIVE = frozenset(WorkerState) - {WorkerState.RETIRED}
_UNREADY = (WorkerState.STARTING, WorkerState.FAILED, WorkerState.STANDBY)


def reconcile(desired: PoolTarget, actual: PoolActual, now: float) -> Action:
    """The one thing to do now so that the pool's workers become what `desired` says."""
    alive = [w for w in actual.workers if w.state in _ALIVE]
    old = [w for w in alive if w.epoch != desired.epoch]
    # A standby of other weights is stopped too: scaling starts one on the target's weights afterwards.
    old_unready = [w for w in old if w.state in _UNREADY]
    if old_unready:
        return StopWorkers(tuple(w.worker_id for w in old_unready))
    due = [w for w in alive if w.state == WorkerState.FAILED and w.restart_at is not None and now >= w.restart_at]
    if due:  # crash restart: the target still wants the slot filled
        return RestartWorkers(tuple(w.worker_id for w in due))
    if old:
        return _roll(desired, alive, actual)
    return _scale(desired, alive, actual.free_slots)


def rollout_settled(desired: PoolTarget, actual: PoolActual) -> bool:
    """The pool stands where a rollout to `desired` ends: its share of workers serve on the target's weights, and
    no other weights are left but, for a canary, the old ones serving beside them."""
    alive = [w for w in actual.workers if w.state in _ALIVE]
    if any(w.epoch != desired.epoch and w.state in _UNREADY for w in alive):
        return False
    return isinstance(_roll(desired, alive, actual), Done)


def _roll(desired: PoolTarget, alive: list[PlannedWorker], actual: PoolActual) -> Action:
    new = [w for w in alive if w.epoch == desired.epoch]
    old = [w for w in alive if w.epoch != desired.epoch]
    if any(w.state in (WorkerState.STARTING, WorkerState.FAILED) for w in new):
        return Wait("a new worker is starting")
    if any(w.state == WorkerState.SERVING and not w.linked for w in new):
        # Serving for the daemon, but not yet for the frontend: draining old workers now could leave a moment in
        # which no worker takes new requests.
        return Wait("the frontend has no live link to a new worker yet")
    new_serving = [w for w in new if w.state == WorkerState.SERVING]
    old_serving = [w for w in old if w.state == WorkerState.SERVING]
    old_draining = [w for w in old if w.state == WorkerState.DRAINING]
    if desired.strategy == RolloutStrategy.SURGE:
        return _surge(desired, new, new_serving, old_serving, old_draining, actual.free_slots)
    return _in_place(desired, new, new_serving, old_serving, old_draining, actual.own_slots)


def _surge(desired, new, new_serving, old_serving, old_draining, free_slots) -> Action:
    if new_serving and old_serving and not desired.is_canary:
        return DrainWorkers(tuple(w.worker_id for w in old_serving))
    if len(new) < desired.count_wanted:
        if free_slots:
            return StartWorker(free_slots[0])
        if old_draining:
            return Wait("waiting for an old worker to drain and free its group")
        return Stuck("no spare group to start a new worker on (spare_devices)")
    return _rolled(desired, new_serving, old_serving, old_draining)


def _in_place(desired, new, new_serving, old_serving, old_draining, own_slots) -> Action:
    if old_draining:
        return Wait("waiting for an old worker to drain")
    if len(new) < desired.count_wanted:
        if own_slots:
            return StartWorker(own_slots[0])
        if old_serving:
            return DrainWorkers((old_serving[0].worker_id,))
        return Stuck("no group to restart on the new weights")
    if new_serving and old_serving and not desired.is_canary:
        return DrainWorkers((old_serving[0].worker_id,))
    return _rolled(desired, new_serving, old_serving, old_draining)


def _rolled(desired, new_serving, old_serving, old_draining) -> Action:
    if len(new_serving) < desired.count_wanted:
        return Wait("a new worker is not serving yet")
    if old_draining or (old_serving and not desired.is_canary):
        return Wait("waiting for old workers to drain")
    return Done()


def _scale(desired: PoolTarget, workers: list[PlannedWorker], free_slots: tuple[int, ...]) -> Action:
    if any(w.state == WorkerState.FAILED for w in workers):
        return Wait("a worker is restarting")
    serving = [w for w in workers if w.state == WorkerState.SERVING]
    standby = [w for w in workers if w.state == WorkerState.STANDBY]
    loading = [w for w in workers if w.state == WorkerState.STARTING and not w.standby]
    loading_standby = [w for w in workers if w.state == WorkerState.STARTING and w.standby]
    if len(serving) + len(loading) < desired.serving:
        if standby or loading_standby:
            return PromoteWorkers(((standby or loading_standby)[0].worker_id,))
        if free_slots:
            return StartWorker(free_slots[0])
        return Wait("no free group to scale up on")
    if len(serving) + len(loading) > desired.serving:
        if loading:
            return Wait("a worker is starting")  # it is drained or demoted once it serves
        if len(standby) + len(loading_standby) < desired.standby:
            return DemoteWorkers((serving[-1].worker_id,))
        return DrainWorkers((serving[-1].worker_id,))
    if len(standby) + len(loading_standby) < desired.standby and free_slots:
        return StartWorker(free_slots[0], standby=True)
    if len(standby) + len(loading_standby) > desired.standby:
        if loading_standby:  # it has cost part of a warm-up; a warm one let go would cost a whole one to get back
            return StopWorkers((loading_standby[-1].worker_id,))
        return DrainWorkers((standby[-1].worker_id,))
    return Wait("a worker is starting") if loading or loading_standby else Done()
