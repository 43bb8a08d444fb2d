"""daemon.scaling_plan: the serving and standby counts the autoscaler asks for, one action at a time, a standby
promoted before anything loads."""

from __future__ import annotations

import pytest

from daemon.rollout_plan import DemoteWorkers, Done, DrainWorkers, PlannedWorker, PromoteWorkers, StartWorker, Wait
from daemon.scaling_plan import next_scaling_action
from frontend.control_messages import WorkerState

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
        (1, 1, (SERVING, FAILED), [2], Wait("a worker is restarting")),
        (3, 0, (SERVING, SERVING), [], Wait("no free group to scale up on")),
        (1, 1, (SERVING, STANDBY, DRAINING), [], Done()),  # a drain in flight does not block the rest
    ],
)
def test_each_state_gets_the_one_action_that_moves_it_toward_the_counts(serving, standby, states, spare, expected):
    assert next_scaling_action(serving, standby, workers(*states), spare) == expected
