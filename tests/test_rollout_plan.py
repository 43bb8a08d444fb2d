"""Whole rollouts walked step by step through daemon.reconcile.reconcile, and the frontend's routing by them.

A tiny simulator plays the worker pool: it carries out each action (a started worker loads, then serves; a drained
one retires and frees its group) and checks, after every change, what a user of the model would notice: that a surge
always has something serving, that an in-place rollout never takes two groups down at once, and that every rollout
ends with exactly `target_count` workers, all on the target weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from common.lanes import DrainAction, RolloutPhase, RolloutStrategy, WorkerState
from daemon.reconcile import (
    Action,
    Done,
    DrainWorkers,
    PlannedWorker,
    PoolActual,
    PoolTarget,
    StartWorker,
    StopWorkers,
    Stuck,
    Wait,
    reconcile,
    rollout_settled,
)
from frontend.control_messages import RolloutStatus, WorkerSet
from frontend.worker_set_view import WorkerSetView

SURGE, IN_PLACE = RolloutStrategy.SURGE, RolloutStrategy.IN_PLACE
SERVING, STARTING, DRAINING, FAILED = (WorkerState.SERVING, WorkerState.STARTING, WorkerState.DRAINING,
                                       WorkerState.FAILED)  # fmt: skip
OLD, NEW = 0, 1  # epochs: the configuration's weights, and the rollout's


def Target(epoch: int, strategy: RolloutStrategy, count: int, canary_percent: int = 0) -> PoolTarget:  # noqa: N802
    """A rollout's target for a pool of `count` workers (the counts a scaling target would have too)."""
    return PoolTarget(epoch, count, strategy=strategy, canary_percent=canary_percent)


def next_action(target: PoolTarget, workers: list[PlannedWorker], free_slots: list[int]) -> Action:
    """The reconciler's action for a pool whose free groups are all its own (an in-place rollout may take them)."""
    actual = PoolActual(tuple(workers), own_slots=tuple(free_slots))
    action = reconcile(target, actual, now=0.0)
    assert rollout_settled(target, actual) == (action == Done()), (action, workers)  # the phase settles with it
    return action


# How the processes keep pace with the plan: "eager" (each action's effect shows before the plan is asked again),
# or only while the plan waits, one worker at a time: loading ones first, or draining ones first.
PACES = ("eager", "starts-first", "retires-first")


@dataclasses.dataclass
class Model:
    """One model's workers and the groups its new workers may take (own groups, plus the spares for surge)."""

    workers: list[PlannedWorker]
    slots: list[int]
    started: int = 0
    asked: list[tuple[PlannedWorker, ...]] = dataclasses.field(default_factory=list)  # each state the plan saw

    @classmethod
    def serving(cls, count: int, spares: int = 0, epoch: int = OLD) -> Model:
        workers = [PlannedWorker(f"m/{slot}", epoch, SERVING, slot) for slot in range(count)]
        return cls(workers, list(range(count + spares)))

    def spare_slots(self) -> list[int]:
        held = {worker.slot for worker in self.workers}
        return [slot for slot in self.slots if slot not in held]

    def on(self, epoch: int, state: WorkerState | None = None) -> list[PlannedWorker]:
        return [w for w in self.workers if w.epoch == epoch and (state is None or w.state == state)]

    def in_state(self, state: WorkerState) -> list[PlannedWorker]:
        return [w for w in self.workers if w.state == state]

    def start(self, slot: int, epoch: int) -> PlannedWorker:
        self.started += 1
        worker = PlannedWorker(f"m/{slot}@{epoch}#{self.started}", epoch, STARTING, slot)
        self.workers.append(worker)
        return worker

    def set_state(self, worker: PlannedWorker, state: WorkerState) -> None:
        self.workers[self.workers.index(worker)] = dataclasses.replace(worker, state=state)

    def retire(self, worker: PlannedWorker) -> None:
        self.workers.remove(worker)

    def progress(self, pace: str) -> bool:
        """One loading worker serves or one draining worker retires; False when nothing is under way."""
        starting, draining = self.in_state(STARTING), self.in_state(DRAINING)
        if draining and (pace == "retires-first" or not starting):
            self.retire(draining[0])
            return True
        if starting:
            self.set_state(starting[0], SERVING)
            return True
        return False


def roll(target: Target, model: Model, watch: Callable[[Model], None], pace: str = "eager") -> Action:
    """Asks the plan and carries out its actions until it says Done or Stuck; `watch` checks every state."""
    watch(model)
    for _ in range(200):
        model.asked.append(tuple(model.workers))
        action = next_action(target, list(model.workers), model.spare_slots())
        if isinstance(action, Done | Stuck):
            return action
        if isinstance(action, StartWorker):
            assert action.slot in model.spare_slots(), f"started on a held group: {action}"
            worker = model.start(action.slot, target.epoch)
            watch(model)
            if pace == "eager":
                model.set_state(worker, SERVING)
                watch(model)
        elif isinstance(action, StopWorkers):  # nothing runs there: they exit (and retire) at once
            for worker in [w for w in model.workers if w.worker_id in action.worker_ids]:
                model.set_state(worker, DRAINING)
                model.retire(model.in_state(DRAINING)[-1])
            watch(model)
        elif isinstance(action, DrainWorkers):
            drained = [w for w in model.workers if w.worker_id in action.worker_ids]
            assert len(drained) == len(action.worker_ids) and all(w.state != DRAINING for w in drained), action
            for worker in drained:
                model.set_state(worker, DRAINING)
            watch(model)
            while pace == "eager" and model.in_state(DRAINING):
                model.retire(model.in_state(DRAINING)[0])
                watch(model)
        else:
            assert isinstance(action, Wait), action
            assert model.progress(pace), f"the plan waits for nothing: {action.reason}"
            watch(model)
    raise AssertionError("the rollout never ended")


def user_view(target: Target) -> Callable[[Model], None]:
    """What must hold at every moment of a rollout of the target's strategy."""

    def watch(model: Model) -> None:
        serving = model.in_state(SERVING)
        if target.strategy == SURGE:
            assert serving, f"nothing serves: {model.workers}"
            if any(w.epoch != target.epoch for w in model.in_state(DRAINING)):
                assert model.on(target.epoch, SERVING), f"old weights drain before new ones serve: {model.workers}"
        else:
            down = [w for w in model.workers if w.state != SERVING]
            assert len(down) <= 1, f"two groups down at once: {down}"
            assert len(serving) >= target.serving - 1, model.workers

    return watch


def assert_all_on(model: Model, target: Target) -> None:
    assert len(model.workers) == target.serving, model.workers
    assert all(w.epoch == target.epoch and w.state == SERVING for w in model.workers), model.workers
    assert len({w.slot for w in model.workers}) == target.serving


# (strategy, workers, spare groups)
ROLLOUTS = [
    (SURGE, 1, 1),
    (SURGE, 2, 1),
    (SURGE, 3, 1),
    (SURGE, 3, 2),
    (SURGE, 2, 4),
    (IN_PLACE, 1, 0),
    (IN_PLACE, 3, 0),
    (IN_PLACE, 4, 0),
]


@pytest.mark.parametrize("pace", PACES)
@pytest.mark.parametrize(("strategy", "count", "spares"), ROLLOUTS)
def test_a_rollout_ends_with_every_worker_on_the_new_weights(strategy, count, spares, pace):
    target = Target(NEW, strategy, count)
    model = Model.serving(count, spares)
    assert roll(target, model, user_view(target), pace) == Done()
    assert_all_on(model, target)


def test_surge_drains_every_old_worker_once_one_new_worker_serves():
    model = Model.serving(3, spares=1)
    target = Target(NEW, SURGE, 3)
    assert next_action(target, model.workers, model.spare_slots()) == StartWorker(3)
    model.set_state(model.start(3, NEW), SERVING)
    assert next_action(target, model.workers, model.spare_slots()) == DrainWorkers(("m/0", "m/1", "m/2"))


@pytest.mark.parametrize(("strategy", "spares"), [(SURGE, 1), (IN_PLACE, 0)])
def test_no_old_worker_drains_for_a_new_one_the_frontend_cannot_route_to_yet(strategy, spares):
    """The daemon marks a worker serving on its heartbeat; the frontend's link to it (its ready, taken on the
    connection the frontend opened) can come a moment later. Draining the old workers in that moment would leave
    none taking new requests, so the plan waits for the frontend's word (LiveLinks)."""
    model = Model.serving(2, spares)
    target = Target(NEW, strategy, 2)
    while not model.on(NEW):  # to the first new worker (in place: once its group is free)
        action = next_action(target, model.workers, model.spare_slots())
        if isinstance(action, DrainWorkers):
            model.set_state(next(w for w in model.workers if w.worker_id in action.worker_ids), DRAINING)
        elif isinstance(action, StartWorker):
            model.start(action.slot, NEW)
        else:
            assert isinstance(action, Wait), action
            model.retire(model.in_state(DRAINING)[0])
    new = model.on(NEW)[0]
    unlinked = dataclasses.replace(new, state=SERVING, linked=False)
    model.workers[model.workers.index(new)] = unlinked
    assert isinstance(next_action(target, model.workers, model.spare_slots()), Wait)
    model.workers[model.workers.index(unlinked)] = dataclasses.replace(unlinked, linked=True)
    action = next_action(target, model.workers, model.spare_slots())
    old_serving = {w.worker_id for w in model.on(OLD, SERVING)}
    assert isinstance(action, DrainWorkers) and set(action.worker_ids) <= old_serving, action


def test_in_place_restarts_one_group_at_a_time():
    model = Model.serving(3)
    target = Target(NEW, IN_PLACE, 3)
    assert next_action(target, model.workers, model.spare_slots()) == DrainWorkers(("m/0",))
    model.set_state(model.workers[0], DRAINING)
    assert isinstance(next_action(target, model.workers, model.spare_slots()), Wait)
    model.retire(model.workers[0])
    assert next_action(target, model.workers, model.spare_slots()) == StartWorker(0)


# (strategy, workers, spare groups, canary percent, new workers the canary holds at)
CANARIES = [
    (SURGE, 2, 1, 10, 1),
    (SURGE, 4, 1, 25, 1),
    (SURGE, 4, 2, 50, 2),
    (SURGE, 10, 3, 25, 3),
    (IN_PLACE, 3, 0, 1, 1),
    (IN_PLACE, 3, 0, 34, 2),
    (IN_PLACE, 4, 0, 50, 2),
    (IN_PLACE, 10, 0, 25, 3),
]


@pytest.mark.parametrize("pace", PACES)
@pytest.mark.parametrize(("strategy", "count", "spares", "percent", "held_at"), CANARIES)
def test_a_canary_holds_at_its_share_until_it_is_lifted(strategy, count, spares, percent, held_at, pace):
    canary = Target(NEW, strategy, count, canary_percent=percent)
    assert canary.is_canary and canary.count_wanted == held_at == max(1, math.ceil(count * percent / 100))
    model = Model.serving(count, spares)
    assert roll(canary, model, user_view(canary), pace) == Done()
    assert len(model.on(NEW, SERVING)) == len(model.on(NEW)) == held_at
    old_left = count if strategy == SURGE else count - held_at  # surge starts its canary beside every old worker
    assert len(model.on(OLD, SERVING)) == len(model.on(OLD)) == old_left

    lifted = Target(NEW, strategy, count, canary_percent=0)
    assert roll(lifted, model, user_view(lifted), pace) == Done()
    assert_all_on(model, lifted)


@pytest.mark.parametrize("percent", [0, 100])
def test_no_canary_at_0_or_100_percent(percent):
    target = Target(NEW, SURGE, 4, canary_percent=percent)
    assert not target.is_canary and target.count_wanted == 4


def test_surge_is_stuck_without_a_spare_group_and_waits_while_one_frees_up():
    model = Model.serving(2)
    target = Target(NEW, SURGE, 2)
    assert isinstance(next_action(target, model.workers, model.spare_slots()), Stuck)

    model = Model.serving(2, spares=1)
    model.set_state(model.start(2, NEW), SERVING)
    model.set_state(model.workers[0], DRAINING)
    model.set_state(model.workers[1], DRAINING)
    assert model.spare_slots() == []
    assert isinstance(next_action(target, model.workers, model.spare_slots()), Wait)


def forward_states(strategy: str, count: int, spares: int, percent: int) -> list[tuple[PlannedWorker, ...]]:
    """Every state the plan saw on the way from the old weights to the new ones (or to a held canary)."""
    target = Target(NEW, strategy, count, percent)
    model = Model.serving(count, spares)
    roll(target, model, user_view(target))
    return model.asked


@pytest.mark.parametrize(
    ("strategy", "count", "spares", "percent"),
    [(SURGE, 2, 1, 0), (SURGE, 3, 2, 0), (SURGE, 4, 2, 50), (IN_PLACE, 3, 0, 0), (IN_PLACE, 4, 0, 50)],
)
def test_a_rollback_from_any_point_of_a_rollout_converges_on_the_old_weights(strategy, count, spares, percent):
    states = forward_states(strategy, count, spares, percent)
    assert len(states) > 2
    for state in states:
        back = Target(OLD, strategy, count)
        model = Model(list(state), list(range(count + spares)))
        assert roll(back, model, user_view(back)) == Done(), state
        assert_all_on(model, back)


# An old-epoch worker that is still loading (a rollback while the new weights load) or crash-looping (FAILED,
# restarted with backoff) must not outlive the rollout: left alive it would serve later, and on the highest
# epoch take every new request; in place, it would hold the group the new weights need.
@pytest.mark.parametrize(
    ("strategy", "target_epoch", "left_behind"),
    [
        (SURGE, OLD, PlannedWorker("m/2@1", NEW, STARTING, 2)),  # rolled back while the new weights load
        (IN_PLACE, OLD, PlannedWorker("m/0@1", NEW, STARTING, 0)),
        (SURGE, NEW, PlannedWorker("m/1", OLD, FAILED, 1)),  # an old worker crash-loops during the rollout
        (IN_PLACE, NEW, PlannedWorker("m/1", OLD, FAILED, 1)),
    ],
)
def test_no_worker_of_another_epoch_outlives_a_rollout(strategy, target_epoch, left_behind):
    serving_old = [PlannedWorker(f"m/{slot}", OLD, SERVING, slot) for slot in range(2) if slot != left_behind.slot]
    model = Model([*serving_old, left_behind], [0, 1, 2] if strategy == SURGE else [0, 1])
    target = Target(target_epoch, strategy, 2)
    assert roll(target, model, lambda model: None, pace="starts-first") == Done()
    assert_all_on(model, target)


# -- the frontend's routing --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str
    epoch: int


def view_with(*statuses: tuple[str, int, int]) -> WorkerSetView:
    """A view that received a set with these (phase, epoch, canary_percent) rollouts of models a, b, ..."""
    rollouts = [
        RolloutStatus(chr(ord("a") + i), RolloutPhase(phase), epoch, f"/w/{epoch}", "/w/0", SURGE, percent)
        for i, (phase, epoch, percent) in enumerate(statuses)
    ]
    view = WorkerSetView()
    view.update(WorkerSet(7, [], rollouts, drain_timeout_s=30.0, on_drain_timeout=DrainAction.MIGRATE))
    assert (view.version, view.drain_timeout_s, view.on_drain_timeout) == (7, 30.0, "migrate")
    return view


OLD_A, OLD_B, NEW_A, NEW_B = Candidate("old-a", 1), Candidate("old-b", 1), Candidate("new-a", 2), Candidate("new-b", 2)


@pytest.mark.parametrize("phase", ["none", "rolling", "rolling-back", "done", "failed"])
def test_new_requests_go_to_the_newest_weights_only(phase):
    view = view_with((phase, 2, 0))
    assert view.route("a", [OLD_A, NEW_A, OLD_B, NEW_B], draw=0.0) == [NEW_A, NEW_B]
    assert view.route("a", [OLD_A, OLD_B], draw=0.0) == [OLD_A, OLD_B]  # the new ones are busy or not serving
    assert view.route("unknown", [NEW_A, OLD_A], draw=0.5) == [NEW_A]
    assert view.route("a", [], draw=0.5) == []


def test_a_canary_gets_its_share_of_requests_by_their_draw():
    view = view_with(("canary", 2, 25))
    candidates = [OLD_A, NEW_A, OLD_B]
    assert view.route("a", candidates, draw=0.0) == [NEW_A]
    assert view.route("a", candidates, draw=0.2499) == [NEW_A]
    assert view.route("a", candidates, draw=0.25) == [OLD_A, OLD_B]
    assert view.route("a", candidates, draw=0.999) == [OLD_A, OLD_B]
    draws = [i / 1000 for i in range(1000)]
    assert sum(view.route("a", candidates, draw) == [NEW_A] for draw in draws) == 250


@pytest.mark.parametrize("candidates", [[OLD_A, OLD_B], [NEW_A, NEW_B]])
@pytest.mark.parametrize("draw", [0.0, 0.1, 0.9])
def test_a_canary_falls_back_to_every_candidate_when_one_side_has_none(candidates, draw):
    view = view_with(("canary", 2, 25))
    assert view.route("a", candidates, draw) == candidates


def test_only_rolling_and_rolling_back_count_as_rolling():
    view = view_with(("rolling", 2, 0), ("rolling-back", 1, 0), ("canary", 2, 10), ("done", 2, 0), ("failed", 1, 0),
                     ("none", 0, 0))  # fmt: skip
    assert [view.is_rolling(model) for model in "abcdef"] == [True, True, False, False, False, False]
    assert not view.is_rolling("unknown")
    assert not WorkerSetView().is_rolling("a")


@pytest.mark.parametrize("phase", ["rolling", "rolling-back", "done"])
def test_after_a_rollback_new_requests_go_to_the_targeted_older_weights_once_they_serve(phase):
    view = view_with((phase, 1, 0))  # the rollout targets epoch 1 again; epoch 2 still drains out
    assert view.route("a", [NEW_A, OLD_A, NEW_B], draw=0.0) == [OLD_A]
    assert view.route("a", [NEW_A, NEW_B], draw=0.0) == [NEW_A, NEW_B]  # until they serve, the newest do
