"""WorkerPool in process over fake children and a fake clock: warm-up, crash restart with back-off, rollouts (surge,
in place, canary, rollback, new weights that cannot serve), scaling and demotion, and P/D pools each on the spare
groups of their own role. What the frontend and an operator would see: the worker set and the rollout status."""

from __future__ import annotations

import pytest
from worker_fakes import FakeChildren, FakeClock, FakeLog

from common.exit_codes import EXIT_CONFIG_ERROR
from common.lanes import Pool, Role, RolloutPhase, RolloutStrategy, WorkerState
from daemon.config import ServeConfig
from daemon.worker_pool import CannotServe, WorkerPool
from frontend.spec import AutoscaleSpec

pytestmark = pytest.mark.fast

SERVING, STARTING, STANDBY, DRAINING, FAILED = (WorkerState.SERVING, WorkerState.STARTING, WorkerState.STANDBY,
                                                WorkerState.DRAINING, WorkerState.FAILED)  # fmt: skip
TICK_S = 0.1


class Harness:
    """A pool and the hands of the processes around it: warm-ups, exits, and the frontend's drains."""

    def __init__(self, tmp_path, device: str = "cpu,cpu", spare: str = "", min_standby: int = 0, **options):
        self.clock, self.children = FakeClock(), FakeChildren()
        config = ServeConfig(device=device, spare_devices=spare, autoscale=AutoscaleSpec(min_standby=min_standby),
                             **options)  # fmt: skip
        self.pool = WorkerPool(config, tmp_path, FakeLog(), self.children, self.clock)
        self.model = next(iter(self.pool.rollouts))
        self.pool.start_all()

    def tick(self, seconds: float = TICK_S) -> None:
        self.pool.tick(self.clock.advance(seconds))

    def states(self) -> dict[str, WorkerState]:
        return {info.worker_id: info.state for info in self.pool.infos()}

    def child(self, worker_id: str):
        return self.children.scheduler(worker_id)

    def warm(self, *worker_ids: str) -> None:
        """These workers' loops run (all starting ones by default), seen at the next tick."""
        for info in self.pool.infos():
            if (info.worker_id in worker_ids or not worker_ids) and info.state == STARTING:
                self.child(info.worker_id).warm_up()
        self.tick()

    def retire_drained(self) -> None:
        """Every draining worker's streams end and it exits 0, as the frontend's drain makes it."""
        for info in self.pool.infos():
            if info.state == DRAINING and self.child(info.worker_id).is_running:
                self.child(info.worker_id).exit(0)
        self.tick()

    def settle(self, steps: int = 40) -> None:
        for _ in range(steps):
            self.warm()
            self.retire_drained()

    def status(self):
        return self.pool.status(self.model)


@pytest.fixture
def harness(tmp_path):
    return lambda **options: Harness(tmp_path, **options)


def test_workers_serve_once_warm_and_their_warm_up_is_measured(harness):
    h = harness()
    assert set(h.states().values()) == {STARTING}
    h.clock.advance(4.0)
    h.warm()
    assert set(h.states().values()) == {SERVING}
    assert [info.warmup_seconds for info in h.pool.infos()] == [4.1, 4.1]
    assert h.pool.version > 0


def test_a_crashed_worker_restarts_after_a_back_off_that_doubles(harness):
    h = harness(device="cpu")
    h.warm()
    (worker_id,) = h.states()
    child = h.child(worker_id)
    child.exit(1)
    h.tick()
    assert h.states() == {worker_id: FAILED}
    h.tick(0.3)  # the first back-off is 0.5 s
    assert h.states() == {worker_id: FAILED} and child.starts == 1
    h.tick(0.3)
    assert h.states() == {worker_id: STARTING} and child.starts == 2
    child.exit(1)  # again before it served: 1 s now
    h.tick()
    h.tick(0.9)
    assert child.starts == 2
    h.tick(0.2)
    assert child.starts == 3
    h.warm()
    assert h.states() == {worker_id: SERVING}


def test_a_configured_worker_that_cannot_start_stops_the_daemon(harness):
    h = harness(device="cpu")
    (worker_id,) = h.states()
    h.child(worker_id).exit(EXIT_CONFIG_ERROR)
    with pytest.raises(CannotServe) as raised:
        h.tick()
    assert raised.value.exit_code == EXIT_CONFIG_ERROR


def test_a_configured_worker_that_keeps_crashing_stops_the_daemon_after_eight_restarts(harness):
    h = harness(device="cpu")
    (worker_id,) = h.states()
    child = h.child(worker_id)
    with pytest.raises(CannotServe) as raised:
        for _ in range(200):
            if child.is_running:
                child.exit(1)  # 5 s after it started: never up the 30 s that would count as recovered
            h.tick(5.0)
    assert raised.value.exit_code == 1 and child.starts == 9


def test_a_worker_that_does_not_reach_its_loop_within_the_start_timeout_is_killed_and_restarted(harness):
    h = harness(device="cpu", worker_start_timeout=60.0)
    (worker_id,) = h.states()
    child = h.child(worker_id)
    h.tick(59.0)  # a slow load is not a failed one
    assert child.is_running and h.states() == {worker_id: STARTING}
    h.tick(2.0)  # past the deadline: its loader spins (a malformed model file) and is killed
    assert not child.is_running and child.processes[0].returncode == -9
    h.tick()
    assert h.states() == {worker_id: FAILED} and child.consecutive_failures == 1  # a failed start, backed off
    h.tick(1.0)
    h.warm()
    assert h.states() == {worker_id: SERVING} and child.starts == 2


def test_a_rollouts_worker_that_keeps_missing_the_start_timeout_fails_the_rollout(harness):
    h = harness(spare="cpu", worker_start_timeout=60.0)
    h.warm()
    old = set(h.states())
    h.pool.begin_rollout(h.model, "/weights/spins", RolloutStrategy.SURGE, 0)
    for _ in range(20):
        h.tick(31.0)  # the new worker never reaches its loop
    assert h.status().phase == RolloutPhase.FAILED and "worker_start_timeout" in h.status().error
    assert set(h.states()) == old and set(h.states().values()) == {SERVING}


def test_a_surge_starts_on_the_spare_then_drains_every_old_worker_at_once(harness):
    h = harness(spare="cpu")
    h.warm()
    old = set(h.states())
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)
    h.tick()
    new = set(h.states()) - old
    assert len(new) == 1 and h.states()[next(iter(new))] == STARTING
    assert all(h.states()[w] == SERVING for w in old)  # maxUnavailable 0
    h.warm()
    h.tick()
    assert all(h.states()[w] == DRAINING for w in old)
    h.settle()
    status = h.status()
    assert (status.phase, status.epoch, status.path, status.previous_path) == (RolloutPhase.DONE, 1, "/weights/v2",
                                                                                status.previous_path)  # fmt: skip
    infos = h.pool.infos()
    assert len(infos) == 2 and all(i.epoch == 1 and i.state == SERVING for i in infos)


def test_in_place_takes_one_group_down_at_a_time(harness):
    h = harness()
    h.warm()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.IN_PLACE, 0)
    down_at_once = 0
    for _ in range(40):
        h.tick()
        down_at_once = max(down_at_once, 2 - sum(s == SERVING for s in h.states().values()))
        h.warm()
        h.retire_drained()
    assert down_at_once == 1
    assert h.status().phase == RolloutPhase.DONE
    assert sorted((i.epoch, i.group) for i in h.pool.infos()) == [(1, "0"), (1, "1")]


def test_a_canary_holds_beside_the_old_workers_until_lifted(harness):
    h = harness(spare="cpu,cpu")
    h.warm()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 50)
    h.settle()
    assert h.status().phase == RolloutPhase.CANARY and h.status().canary_percent == 50
    by_epoch = sorted((i.epoch, i.state) for i in h.pool.infos())
    assert by_epoch == [(0, SERVING), (0, SERVING), (1, SERVING)]
    assert not h.pool.is_rolling(h.model)  # a canary is not in progress: the autoscaler may act
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)  # the same weights: lifted
    h.settle()
    assert h.status().phase == RolloutPhase.DONE and h.status().epoch == 1
    assert sorted((i.epoch, i.state) for i in h.pool.infos()) == [(1, SERVING), (1, SERVING)]


def test_a_rollback_returns_to_the_old_weights(harness):
    h = harness(spare="cpu")
    h.settle()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)
    h.settle()
    h.pool.roll_back(h.model, RolloutStrategy.SURGE)
    h.settle()
    status = h.status()
    assert (status.phase, status.epoch) == (RolloutPhase.DONE, 0)
    assert all(i.epoch == 0 and i.state == SERVING for i in h.pool.infos()) and len(h.pool.infos()) == 2


def test_new_weights_that_never_serve_fail_the_rollout_back_to_the_old_ones(harness):
    h = harness(spare="cpu")
    h.settle()
    old = set(h.states())
    h.pool.begin_rollout(h.model, "/weights/broken", RolloutStrategy.SURGE, 0)
    for _ in range(3):  # crashes before it ever serves, three times: its weights cannot serve
        h.tick()
        (new,) = set(h.states()) - old
        h.child(new).exit(1)
        h.tick()
        h.tick(1.5)  # past its back-off
    h.settle()
    status = h.status()
    assert (status.phase, status.epoch, status.path) == (RolloutPhase.FAILED, 0, status.previous_path or status.path)
    assert "exited with 1" in status.error
    assert set(h.states()) == old and set(h.states().values()) == {SERVING}
    assert not any(s.failed for s in h.pool.slots)  # the weights failed, not the group


def test_scaling_starts_on_a_spare_group_and_drains_the_newest_going_down(harness):
    h = harness(device="cpu", spare="cpu,cpu")
    h.settle()
    h.pool.scale(h.model, 3, 0, "ttft")
    h.settle()
    assert sum(s == SERVING for s in h.states().values()) == 3
    newest = h.pool.infos()[-1].worker_id
    h.pool.scale(h.model, 2, 0, "quiet")
    h.tick()
    assert h.states()[newest] == DRAINING
    h.settle()
    assert len(h.states()) == 2


def test_going_down_while_a_standby_is_wanted_demotes_the_newest_and_promotes_it_back(harness):
    h = harness(device="cpu", spare="cpu")
    h.pool.scale(h.model, 2, 0, "ttft")
    h.settle()
    newest = h.pool.infos()[-1].worker_id
    h.pool.scale(h.model, 1, 1, "quiet")
    h.tick()
    assert h.states()[newest] == STANDBY and h.child(newest).is_running
    starts = h.child(newest).starts
    h.pool.scale(h.model, 2, 1, "ttft")
    h.tick()
    assert h.states()[newest] == SERVING and h.child(newest).starts == starts  # a routing flip, no warm-up


def test_min_standby_keeps_a_warm_standby_that_a_scale_up_promotes(harness):
    h = harness(device="cpu", spare="cpu,cpu", min_standby=1)
    h.settle()
    standbys = [i for i in h.pool.infos() if i.state == STANDBY]
    assert len(standbys) == 1 and standbys[0].standby
    h.pool.scale(h.model, 2, 1, "queue")
    h.tick()
    assert h.states()[standbys[0].worker_id] == SERVING
    h.settle()  # a new standby behind it, on the last spare
    assert sorted(h.states().values()) == [SERVING, SERVING, STANDBY]


def test_prefill_and_decode_pools_scale_each_on_the_spare_groups_of_their_role(harness):
    h = harness(device="cpu=prefill,cpu=decode", spare="cpu=decode,cpu=prefill")
    h.settle()
    h.pool.scale(h.model, 2, 0, "ttft", Pool.PREFILL)
    h.settle()
    roles = sorted(i.role for i in h.pool.infos())
    assert roles == [Role.DECODE, Role.PREFILL, Role.PREFILL]
    h.pool.scale(h.model, 2, 0, "queue", Pool.ROUTED)
    h.settle()
    assert sorted(i.role for i in h.pool.infos()) == [Role.DECODE, Role.DECODE, Role.PREFILL, Role.PREFILL]
    assert {i.role for i in h.pool.infos() if i.group.startswith("spare")} == {Role.DECODE, Role.PREFILL}


def test_a_model_without_prefill_workers_ignores_a_prefill_scale(harness):
    h = harness(device="cpu", spare="cpu")
    version = h.pool.version
    h.pool.scale(h.model, 2, 0, "ttft", Pool.PREFILL)
    assert h.pool.version == version and Pool.PREFILL not in h.pool.targets[h.model]


def test_a_p_d_rollout_keeps_each_pool_on_its_role(harness):
    h = harness(device="cpu=prefill,cpu=decode", spare="cpu=decode")  # no spare prefill group: that pool in place
    h.settle()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)
    h.settle()
    assert h.status().phase == RolloutPhase.DONE
    assert sorted((i.epoch, i.role) for i in h.pool.infos()) == [(1, Role.DECODE), (1, Role.PREFILL)]


@pytest.mark.parametrize("spare", ["cpu=prefill,cpu=decode", "cpu=decode"])
def test_a_p_d_surge_keeps_a_decode_worker_serving_at_every_tick(harness, spare):
    """Each pool's new worker starts on a spare group of its own role (without a spare prefill group, the prefill
    pool goes in place); some decode worker serves after every tick, to the end: one prefill and one decode worker,
    both on the new weights. (test_disaggregated.py's daemon test keeps the first case end to end; the second
    moved here.)"""
    h = harness(device="cpu=prefill,cpu=decode", spare=spare)
    h.settle()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)

    def decode_serves() -> None:
        infos = h.pool.infos()
        assert any(i.role == Role.DECODE and i.state == SERVING for i in infos), [(i.worker_id, i.role, i.state)
                                                                                  for i in infos]  # fmt: skip

    for _ in range(40):
        for step in (h.tick, h.warm, h.retire_drained):
            step()
            decode_serves()
    assert h.status().phase == RolloutPhase.DONE
    assert sorted((i.epoch, i.role, i.state) for i in h.pool.infos()) == [(1, Role.DECODE, SERVING),
                                                                          (1, Role.PREFILL, SERVING)]  # fmt: skip
    new_groups = {i.role: i.group for i in h.pool.infos()}
    spares = dict(reversed(part.split("=")) for part in spare.split(","))  # role -> "cpu"
    assert new_groups[Role.DECODE].startswith("spare") and new_groups[Role.PREFILL].startswith("spare") == (
        "prefill" in spares
    )


def test_a_draining_worker_that_overstays_the_drain_timeout_is_stopped(harness):
    h = harness(spare="cpu")
    h.settle()
    h.pool.begin_rollout(h.model, "/weights/v2", RolloutStrategy.SURGE, 0)
    h.warm()
    h.warm()
    draining = [w for w, s in h.states().items() if s == DRAINING]
    assert draining
    for worker_id in draining:
        h.child(worker_id).process.heeds_sigterm = False
    h.tick(h.pool.config.rollout_drain_timeout + 31.0)
    assert all(h.child(w).process.signals for w in draining)  # SIGTERM: it never heard it is draining
    h.tick(31.0)
    h.tick()
    assert not set(draining) & set(h.states())  # killed, then retired
