"""What a model's worker set does next between rollouts: as many serving workers as the autoscaler wants, and its
pre-warmed standbys. A pure function of the counts and the workers, like daemon.rollout_plan.

Scaling up promotes a standby first (a routing flip: the worker is loaded and warm), then a standby still loading
(it serves once warm), and only then starts a worker that must load; a standby used up is replaced behind it.
Standbys start side by side, each on its own group, so that a reserve for the peak is warm one warm-up later rather
than one warm-up per worker. Scaling down demotes the newest serving worker to a standby while fewer standbys are
wanted than there are (the flip back: its streams finish there, and the warm-up it already paid for is kept), and
otherwise drains it (its streams finish; it retires when it runs nothing). A standby no longer wanted drains too: a
demoted one may still be finishing streams. Nothing is decided while a worker waits to restart, and nothing goes
down while a worker that should serve is still loading.
"""

from __future__ import annotations

from daemon.rollout_plan import (
    Action,
    DemoteWorkers,
    Done,
    DrainWorkers,
    PlannedWorker,
    PromoteWorkers,
    StartWorker,
    Wait,
)
from frontend.control_messages import WorkerState


def next_scaling_action(
    serving_wanted: int, standby_wanted: int, workers: list[PlannedWorker], spare_slots: list[int]
) -> Action:
    """The one thing to do now so that the model has `serving_wanted` serving and `standby_wanted` standby workers
    (all on the current weights: while a rollout runs, daemon.rollout_plan decides alone)."""
    if any(w.state == WorkerState.FAILED for w in workers):
        return Wait("a worker is restarting")
    serving = [w for w in workers if w.state == WorkerState.SERVING]
    standby = [w for w in workers if w.state == WorkerState.STANDBY]
    loading = [w for w in workers if w.state == WorkerState.STARTING and not w.standby]
    loading_standby = [w for w in workers if w.state == WorkerState.STARTING and w.standby]
    if len(serving) + len(loading) < serving_wanted:
        if standby or loading_standby:
            return PromoteWorkers(((standby or loading_standby)[0].worker_id,))
        if spare_slots:
            return StartWorker(spare_slots[0])
        return Wait("no free group to scale up on")
    if len(serving) + len(loading) > serving_wanted:
        if loading:
            return Wait("a worker is starting")  # it is drained or demoted once it serves
        if len(standby) + len(loading_standby) < standby_wanted:
            return DemoteWorkers((serving[-1].worker_id,))
        return DrainWorkers((serving[-1].worker_id,))
    if len(standby) + len(loading_standby) < standby_wanted and spare_slots:
        return StartWorker(spare_slots[0], standby=True)
    if len(standby) + len(loading_standby) > standby_wanted and standby:
        return DrainWorkers((standby[-1].worker_id,))  # one still loading is drained once warm, if still extra
    return Wait("a worker is starting") if loading or loading_standby else Done()
