"""What a model's worker set does next between rollouts: as many serving workers as the autoscaler wants, and its
pre-warmed standbys. A pure function of the counts and the workers, like daemon.rollout_plan.

Scaling up promotes a standby first (a routing flip: the worker is loaded and warm), and only then starts a worker
that must load; a standby used up is replaced behind it. Scaling down drains the newest serving worker (its streams
finish; it retires when it runs nothing). One action at a time: nothing new starts while a worker is starting.
"""

from __future__ import annotations

from daemon.rollout_plan import (
    Action,
    Done,
    DrainWorkers,
    PlannedWorker,
    PromoteWorkers,
    StartWorker,
    StopWorkers,
    Wait,
)
from frontend.control_messages import WorkerState


def next_scaling_action(
    serving_wanted: int, standby_wanted: int, workers: list[PlannedWorker], spare_slots: list[int]
) -> Action:
    """The one thing to do now so that the model has `serving_wanted` serving and `standby_wanted` standby workers
    (all on the current weights: while a rollout runs, daemon.rollout_plan decides alone)."""
    if any(w.state in (WorkerState.STARTING, WorkerState.FAILED) for w in workers):
        return Wait("a worker is starting")
    serving = [w for w in workers if w.state == WorkerState.SERVING]
    standby = [w for w in workers if w.state == WorkerState.STANDBY]
    if len(serving) < serving_wanted:
        if standby:
            return PromoteWorkers((standby[0].worker_id,))
        if spare_slots:
            return StartWorker(spare_slots[0])
        return Wait("no free group to scale up on")
    if len(serving) > serving_wanted:
        return DrainWorkers((serving[-1].worker_id,))
    if len(standby) < standby_wanted and spare_slots:
        return StartWorker(spare_slots[0], standby=True)
    if len(standby) > standby_wanted:
        return StopWorkers((standby[-1].worker_id,))
    return Done()
