"""daemon.reconcile scaling a pool: the serving and standby counts the autoscaler asks for, one action at a time, a
standby promoted before anything loads; and crash restart, a failed worker started again once its back-off is over."""

from __future__ import annotations

import pytest

from common.lanes import WorkerState
from daemon.reconcile import (
    DemoteWorkers,
    Done,
    DrainWorkers,
    PlannedWorker,
    PoolActual,
    PoolTarget,
    PromoteWorkers,
    RestartWorkers,
    StartWorker,
    StopWorkers,
    Wait,
    reconcile,
)

SERVING, STANDBY, STARTING, DRAINING = (
    WorkerState.SERVING,
    WorkerState.STANDBY,
    WorkerState.STARTING,
    WorkerState.DRAINING,
)


STARTING_STANDBY, FAILED = "starting standby", WorkerState.FAILED


def workers(*states) -> list[PlannedWorker]:
    return [
        PlannedWorker(f"m/{i}", 0, STARTING if state == STARTING_STANDBY else state, i, state == STARTING_STANDBY)
        for i, state in enumerate(states)
    ]


@pytest.mark.parametrize(
    ("serving", "standby", "states", "spare", "expected"),
    [
        (2, 1, (SERVING, STANDBY), [2], PromoteWorkers(("m/1",))),  # up: the warm one first
        (2, 0, (SERVING,), [1], StartWorker(1)),  # up with no standby: one must load
        (2, 1, (SERVING, SERVING), [2], StartWorker(2, standby=True)),  # a used standby is replaced
        (1, 1, (SERVING, SERVING, STANDBY), [], DrainWorkers(("m/1",))),  # down: the newest serving drains
        (1, 0, (SERVING, STANDBY), [], DrainWorkers(("m/1",))),  # standbys no longer wanted drain (streams end)
        (1, 1, (SERVING, SERVING), [], DemoteWorkers(("m/1",))),  # down while a standby is wanted: flip it back
        (1, 2, (SERVING, SERVING, STANDBY), [], DemoteWorkers(("m/1",))),  # the peak's reserve stays warm
        (2, 1, (SERVING, STARTING), [2], StartWorker(2, standby=True)),  # standbys load beside a cold start
        (2, 0, (SERVING, STARTING), [2], Wait("a worker is starting")),  # counted as serving already
        (1, 0, (SERVING, STARTING), [], Wait("a worker is starting")),  # nothing goes down while one loads
        (2, 1, (SERVING, STARTING_STANDBY), [], PromoteWorkers(("m/1",))),  # serves once warm
        (1, 3, (SERVING, STARTING_STANDBY), [2], StartWorker(2, standby=True)),  # the reserve loads side by side
        # Fewer standbys wanted: one still loading stops before a warm one drains (the warm one cost a warm-up).
        (1, 1, (SERVING, STANDBY, STARTING_STANDBY), [], StopWorkers(("m/2",))),
        (1, 1, (SERVING, FAILED), [2], Wait("a worker is restarting")),
        (3, 0, (SERVING, SERVING), [], Wait("no free group to scale up on")),
        (1, 1, (SERVING, STANDBY, DRAINING), [], Done()),  # a drain in flight does not block the rest
    ],
)
def test_each_state_gets_the_one_action_that_moves_it_toward_the_counts(serving, standby, states, spare, expected):
    actual = PoolActual(tuple(workers(*states)), spare_slots=tuple(spare))
    assert reconcile(PoolTarget(0, serving, standby), actual, now=0.0) == expected


def test_a_failed_worker_restarts_once_its_back_off_is_over_and_nothing_else_moves_meanwhile():
    failed = PlannedWorker("m/1", 0, FAILED, 1, restart_at=10.0)
    actual = PoolActual((PlannedWorker("m/0", 0, SERVING, 0), failed), spare_slots=(2,))
    target = PoolTarget(0, serving=3, standby=1)
    assert reconcile(target, actual, now=9.9) == Wait("a worker is restarting")
    assert reconcile(target, actual, now=10.0) == RestartWorkers(("m/1",))


def test_a_failed_worker_of_other_weights_is_stopped_not_restarted():
    failed = PlannedWorker("m/1", 0, FAILED, 1, restart_at=0.0)
    actual = PoolActual((PlannedWorker("m/0@1", 1, SERVING, 0), failed))
    assert reconcile(PoolTarget(1, serving=1), actual, now=5.0).worker_ids == ("m/1",)
