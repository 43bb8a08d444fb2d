"""The daemon's worker set: every scheduler process, its slot, weights, epoch and state, and each model's rollout.

The desired set is a PoolTarget per model and pool (daemon.reconcile), written by a rollout command, a rollback or
a failed rollout going back (the epoch, strategy and canary share) and by the autoscaler (the counts). `tick`
notices what the processes did (warmed up: serving; exited after draining: retired; crashed: failed, to restart
after its back-off), then moves each pool towards its target by one reconcile action: the routed workers and, with
prefill workers, those as a second pool, each on the groups of its role. Crash restart is the reconciler's too.
"""

from __future__ import annotations

import collections
import dataclasses
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common.generation import model_generation
from common.lanes import Pool, RolloutPhase, RolloutStrategy, WorkerState
from daemon.child_specs import Slot, slots_of, worker_spec
from daemon.children import Child
from daemon.config import ModelSpec, ServeConfig
from daemon.reconcile import (
    DemoteWorkers,
    DrainWorkers,
    PlannedWorker,
    PoolActual,
    PoolTarget,
    PromoteWorkers,
    RestartWorkers,
    StartWorker,
    StopWorkers,
    Stuck,
    reconcile,
    rollout_settled,
)
from frontend.control_messages import RolloutStatus, WorkerInfo
from gpu_runtime.worker.spec import WorkerSpec

_EVENTS_KEPT = 32
_DRAIN_GRACE_S = 30.0  # past the drain timeout, a draining worker that has not exited is stopped
_ROLLOUT_START_ATTEMPTS = 3
_SETTLED = {RolloutPhase.ROLLING: RolloutPhase.DONE, RolloutPhase.ROLLING_BACK: RolloutPhase.FAILED}

ChildFactory = Callable[..., Child]  # Child's own signature: a test passes a fake


class CannotServe(Exception):
    """A worker of the daemon's own configuration cannot start: the daemon exits with this code."""

    def __init__(self, exit_code: int):
        self.exit_code = exit_code


@dataclass(eq=False)
class Worker:
    child: Child
    spec: WorkerSpec
    model_name: str
    slot: Slot
    epoch: int
    path: str
    state: WorkerState = WorkerState.STARTING
    draining_since: float | None = None
    stop_sent: bool = False
    start_timed_out: bool = False  # killed for missing worker_start_timeout: a failed start, however long it took
    has_served: bool = False  # it got to its loop once: from then on, a restart is a crash restart
    configured: bool = False  # one of the daemon's own configuration, started with it
    standby_when_warm: bool = False  # a pre-warmed standby: loaded and warm, but not routed until promoted
    started_at: float = 0.0
    warmup_seconds: float = 0.0  # from its start to its loop, measured (the autoscaler's horizon)

    @property
    def pool(self) -> Pool:
        return self.slot.role.pool

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.spec.worker_id, self.model_name, self.slot.group, self.slot.devices,
                          self.spec.input_address, self.epoch, self.path, self.state,
                          role=self.slot.role, pid=self.child.pid or 0, warmup_seconds=self.warmup_seconds,
                          standby=self.standby_when_warm and self.state != WorkerState.SERVING)  # fmt: skip

    def planned(self, linked: bool) -> PlannedWorker:
        restart_at = self.child.restart_at if self.state == WorkerState.FAILED else None
        return PlannedWorker(self.spec.worker_id, self.epoch, self.state, self.slot.index, self.standby_when_warm,
                             restart_at, linked)  # fmt: skip


@dataclass(eq=False)
class Rollout:
    """A model's rollout as the operator sees it: the weights its targets point at, those before, where it stands.
    The epoch, strategy and canary share are its pools' targets' (WorkerPool.targets)."""

    model: ModelSpec
    path: str = ""
    weights: str = ""  # what the files at `path` were when this target was set (weights_of)
    history: list[tuple[int, str]] = field(default_factory=list)  # (epoch, path) of the targets before this one
    phase: RolloutPhase = RolloutPhase.NONE
    error: str = ""
    events: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_EVENTS_KEPT))

    def status(self, target: PoolTarget) -> RolloutStatus:
        previous = self.history[-1][1] if self.history else ""
        return RolloutStatus(self.model.name, self.phase, target.epoch, self.path, previous, target.strategy,
                             target.canary_percent, list(self.events), self.error)  # fmt: skip


class WorkerPool:
    def __init__(self, config: ServeConfig, runtime_dir: Path, log, make_child: ChildFactory = Child,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.config = config
        self.runtime_dir = runtime_dir
        self.log = log
        self._make_child = make_child
        self._clock = clock
        self.slots = slots_of(config)
        self.workers: list[Worker] = []
        self.rollouts: dict[str, Rollout] = {}
        self.targets: dict[str, dict[Pool, PoolTarget]] = {}  # the desired set: model -> pool -> its target
        self.version = 0  # of the set as the frontend sees it: bumped at every change
        # The workers the frontend has a live link to (its latest LiveLinks); None until a frontend says (a pool
        # with no frontend speaking to it, as in tests of the pool alone, counts every worker as linked).
        self.frontend_links: frozenset[str] | None = None
        for model in config.served_models():
            home = [slot for slot in self.slots if slot.owner == model.name]
            path = model.path or model.name
            self.rollouts[model.name] = Rollout(model, path=path, weights=weights_of(path))
            counts = collections.Counter(slot.role.pool for slot in home)
            standby = config.autoscale.min_standby
            self.targets[model.name] = {Pool.ROUTED: PoolTarget(0, counts[Pool.ROUTED], standby)}
            if counts[Pool.PREFILL]:
                self.targets[model.name][Pool.PREFILL] = PoolTarget(0, counts[Pool.PREFILL], standby)
            for slot in home:
                self._add_worker(model, slot, 0, path, configured=True)

    # -- the set as others see it -----------------------------------------------------------------------------

    def infos(self) -> list[WorkerInfo]:
        return [worker.info() for worker in self.workers]

    def statuses(self) -> list[RolloutStatus]:
        return [rollout.status(self.targets[name][Pool.ROUTED]) for name, rollout in self.rollouts.items()]

    def spare_slots(self, model_name: str, strategy: RolloutStrategy, pool: Pool | None = None) -> list[int]:
        """Free slots a new worker of the model may take: its own groups, and for surge the unused spares; with
        `pool`, only those of that pool's role."""
        actual = self._free_slots(model_name, pool)
        return list(actual.free_slots if strategy == RolloutStrategy.SURGE else actual.own_slots)

    def _free_slots(self, model_name: str, pool: Pool | None) -> PoolActual:
        held = {worker.slot.index for worker in self.workers}
        free = [s for s in self.slots if s.index not in held and not s.failed and pool in (None, s.role.pool)]
        return PoolActual((), tuple(s.index for s in free if s.owner == model_name),
                          tuple(s.index for s in free if s.owner is None))  # fmt: skip

    def _changed(self, event: str | None = None, model_name: str | None = None, **fields) -> None:
        self.version += 1
        if event is not None:
            self.log.info(event, model=model_name, **fields)
            if model_name in self.rollouts:
                detail = " ".join(f"{key}={value}" for key, value in fields.items())
                self.rollouts[model_name].events.append(f"{time.strftime('%H:%M:%S')} {event} {detail}".strip())

    # -- starting and stopping ------------------------------------------------------------------------------

    def _add_worker(self, model: ModelSpec, slot: Slot, epoch: int, path: str, configured: bool = False) -> Worker:
        spec = worker_spec(self.config, self.runtime_dir, model, slot, epoch, None if configured else path)
        child = self._make_child(
            f"scheduler {spec.worker_id}",
            "gpu_runtime.worker",
            spec.to_json(),
            heartbeat_path=Path(spec.heartbeat_path),
            # Its GPUs only: its engine's "cuda:0" is the first, and no other GPU is within its reach.
            env={} if spec.cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": spec.cuda_visible_devices},
        )
        slot.owner = model.name
        worker = Worker(child, spec, model.name, slot, epoch, path, configured=configured)
        self.workers.append(worker)
        return worker

    def start_all(self) -> None:
        for worker in self.workers:
            self._start(worker)

    def _start(self, worker: Worker) -> None:
        worker.started_at = self._clock()
        worker.child.start(worker.started_at)

    def stop_all(self, timeout: float) -> None:
        for worker in self.workers:
            worker.child.signal(signal.SIGTERM)
        for worker in self.workers:
            worker.child.stop(timeout=timeout)

    # -- the loop -------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Observes every worker, then moves each pool one action towards its target. Raises CannotServe when a
        worker of the daemon's own configuration cannot start."""
        for worker in list(self.workers):
            self._observe(worker, now)
        for model_name in self.rollouts:
            self._reconcile(model_name, now)

    def _observe(self, worker: Worker, now: float) -> None:
        child = worker.child
        if child.process is None:
            return  # failed: the reconciler restarts it once its back-off is over
        code = child.poll()
        if code is None:
            if worker.state == WorkerState.STARTING and child.heartbeat_age(time.time()) is not None:
                worker.state = WorkerState.STANDBY if worker.standby_when_warm else WorkerState.SERVING
                if not worker.has_served:
                    worker.has_served, worker.warmup_seconds = True, round(now - worker.started_at, 3)
                self._changed(f"worker_{worker.state}", worker.model_name, worker=worker.spec.worker_id,
                              epoch=worker.epoch, warmup_s=worker.warmup_seconds)  # fmt: skip
            elif worker.state == WorkerState.STARTING and now - child.started_at > self.config.worker_start_timeout:
                self._kill_overdue_start(worker, now)
            elif worker.state == WorkerState.DRAINING:
                self._enforce_drain_timeout(worker, now)
            return
        if worker.state == WorkerState.DRAINING:
            self.workers.remove(worker)
            self._changed("worker_retired", worker.model_name, worker=worker.spec.worker_id, exit_code=code)
            return
        self._crashed(worker, code, now)

    def _crashed(self, worker: Worker, code: int, now: float) -> None:
        """A worker exited unasked: it restarts after its back-off, or its weights or its group are given up."""
        child, rollout = worker.child, self.rollouts[worker.model_name]
        timed_out, worker.start_timed_out = worker.start_timed_out, False
        reason = child.give_up_reason(code)
        # A worker added later (a rollout's, the autoscaler's) that crashes before it ever served is not retried
        # for minutes: its weights or its group cannot serve.
        if reason is None and not worker.configured and not worker.has_served:
            reason = "cannot_serve" if child.consecutive_failures + 1 >= _ROLLOUT_START_ATTEMPTS else None
        target = self.targets[worker.model_name][Pool.ROUTED]
        if reason is not None and worker.configured and target.epoch == 0:
            self.log.error(reason, child=child.name, exit_code=code)
            raise CannotServe(code if reason == "configuration_error" else 1)
        if reason is None:
            worker.state = WorkerState.FAILED
            # However long it loaded, one that never got to its loop has not recovered: its failures add up.
            child.back_off(code, now, self.log, recovered=False if timed_out else None)
            self._changed()
            return
        self.workers.remove(worker)
        why = f"worker {worker.spec.worker_id} on {worker.path} exited with {code}"
        if timed_out:
            why += f" (killed: not serving within worker_start_timeout, {self.config.worker_start_timeout:g} s)"
        if rollout.phase.holds_target and worker.epoch == target.epoch:
            self._fail_rollout(rollout, why)  # the new weights cannot serve: back to the ones before
        else:  # the group cannot serve (a spare GPU that fails): no worker is started there again
            worker.slot.failed = True
            self._changed("group_failed", worker.model_name, reason=why, devices=worker.slot.devices)

    def _kill_overdue_start(self, worker: Worker, now: float) -> None:
        """A worker that has not reached its loop within worker_start_timeout is killed: the next tick reaps it as
        a failed start (a configured worker restarts after its back-off, a rollout's counts towards giving up its
        weights), so that a loader that spins on a malformed model file cannot hold a group for ever."""
        self.log.error("worker_start_timeout", worker=worker.spec.worker_id, path=worker.path,
                       loading_s=round(now - worker.child.started_at, 1),
                       timeout_s=self.config.worker_start_timeout)  # fmt: skip
        worker.start_timed_out = True
        worker.child.process.kill()

    def _enforce_drain_timeout(self, worker: Worker, now: float) -> None:
        """The worker ends its own streams at the drain timeout and exits; this is the backstop if it does not
        (it never heard it is draining: the frontend was down)."""
        overdue = now - worker.draining_since - self.config.rollout_drain_timeout - _DRAIN_GRACE_S
        if overdue > 0 and not worker.stop_sent:
            worker.stop_sent = True
            self.log.warning("drain_overdue", worker=worker.spec.worker_id)
            worker.child.signal(signal.SIGTERM)
        elif overdue > _DRAIN_GRACE_S and worker.child.process is not None:
            worker.child.process.kill()

    def _reconcile(self, model_name: str, now: float) -> None:
        """One reconcile action for each pool of the model, each on the free groups of its role; a rollout settles
        once every pool stands where it ends, and fails back when one cannot get there."""
        rollout, steps, settled = self.rollouts[model_name], [], True
        for pool, target in self.targets[model_name].items():
            members = [w for w in self.workers if w.model_name == model_name and w.pool is pool]
            free = self._free_slots(model_name, pool)
            links = self.frontend_links
            planned = tuple(w.planned(links is None or w.spec.worker_id in links) for w in members)
            actual = PoolActual(planned, free.own_slots, free.spare_slots)
            if pool is Pool.PREFILL and not actual.free_slots:
                # Without a spare prefill group, the prefill pool rolls one group at a time: while one is down its
                # prompts are computed by the routed workers, so nobody waits.
                target = dataclasses.replace(target, strategy=RolloutStrategy.IN_PLACE)
            steps.append((members, reconcile(target, actual, now)))
            settled = settled and rollout_settled(target, actual)
        stuck = next((action for _, action in steps if isinstance(action, Stuck)), None)
        if stuck is not None and rollout.phase.holds_target:
            self._fail_rollout(rollout, stuck.reason)
            return
        for members, action in steps:
            self._act(rollout, members, action, now)
        if settled and rollout.phase.in_progress:
            canary = self.targets[model_name][Pool.ROUTED].is_canary and rollout.phase is RolloutPhase.ROLLING
            rollout.phase = RolloutPhase.CANARY if canary else _SETTLED[rollout.phase]
            self._changed(f"rollout_{rollout.phase}", model_name, epoch=self.targets[model_name][Pool.ROUTED].epoch,
                          path=rollout.path)  # fmt: skip

    def _act(self, rollout: Rollout, members: list[Worker], action, now: float) -> None:
        """Carries out one pool's action; Wait, Done and Stuck do nothing here."""
        chosen = [w for w in members if w.spec.worker_id in getattr(action, "worker_ids", ())]
        if isinstance(action, StartWorker):
            self._start_new(rollout, self.slots[action.slot], action.standby)
        elif isinstance(action, RestartWorkers):
            for worker in chosen:
                worker.child.restart(now, self.log)
                worker.state = WorkerState.STARTING
                self._changed()
        elif isinstance(action, PromoteWorkers):
            for worker in chosen:
                worker.standby_when_warm = False  # one still loading serves once warm; a restart serves too
                if worker.state == WorkerState.STANDBY:
                    worker.state = WorkerState.SERVING
                self._changed("worker_promoted", rollout.model.name, worker=worker.spec.worker_id)
        elif isinstance(action, DemoteWorkers):
            for worker in chosen:
                worker.state, worker.standby_when_warm = WorkerState.STANDBY, True
                self._changed("worker_demoted", rollout.model.name, worker=worker.spec.worker_id)
        elif isinstance(action, DrainWorkers):
            for worker in chosen:
                self._drain(worker)
        elif isinstance(action, StopWorkers):
            for worker in chosen:
                self._stop_unready(worker)

    def _start_new(self, rollout: Rollout, slot: Slot, standby: bool) -> None:
        epoch = self.targets[rollout.model.name][Pool.ROUTED].epoch
        worker = self._add_worker(rollout.model, slot, epoch, rollout.path)
        worker.standby_when_warm = standby
        self._start(worker)
        self._changed("worker_starting", rollout.model.name, worker=worker.spec.worker_id, epoch=epoch,
                      path=rollout.path, standby=standby, role=worker.slot.role,
                      devices=worker.slot.devices)  # fmt: skip

    def scale(self, model_name: str, serving: int, standby: int, reason: str, pool: Pool = Pool.ROUTED) -> None:
        """The autoscaler's counts for one pool of a model (its prefill workers, or the routed ones); bounded by
        its groups, the spares included."""
        targets = self.targets[model_name]
        if pool not in targets:
            return  # a model without prefill workers has no such pool to scale
        serving = max(1, min(serving, len(self.slots)))
        target = targets[pool]
        if (serving, standby) == (target.serving, target.standby):
            return
        self._changed("scale", model_name, serving=serving, standby=standby, reason=reason, role=pool,
                      previous_serving=target.serving)  # fmt: skip
        targets[pool] = dataclasses.replace(target, serving=serving, standby=standby)

    def _retarget(self, model_name: str, **changes) -> None:
        """A rollout's writes: the same weights, strategy and canary share for every pool of the model."""
        targets = self.targets[model_name]
        for pool, target in targets.items():
            targets[pool] = dataclasses.replace(target, **changes)

    def _drain(self, worker: Worker) -> None:
        """No new requests from now on (the frontend tells the worker, which exits once its streams end)."""
        worker.state, worker.draining_since = WorkerState.DRAINING, self._clock()
        self._changed("worker_draining", worker.model_name, worker=worker.spec.worker_id, epoch=worker.epoch)

    def _stop_unready(self, worker: Worker) -> None:
        """A worker that serves nobody yet stops at once: it retires when it exits (now, if it is not running)."""
        worker.state = WorkerState.DRAINING
        worker.draining_since = self._clock()
        if worker.child.process is None:  # crashed, waiting for its restart
            self.workers.remove(worker)
            self._changed("worker_retired", worker.model_name, worker=worker.spec.worker_id, exit_code=None)
            return
        worker.child.signal(signal.SIGTERM)
        self._changed("worker_stopping", worker.model_name, worker=worker.spec.worker_id, epoch=worker.epoch)

    def _fail_rollout(self, rollout: Rollout, reason: str) -> None:
        rollout.error = reason
        rollout.phase = RolloutPhase.ROLLING_BACK
        changes: dict[str, object] = {"canary_percent": 0}
        if rollout.history:
            changes["epoch"], rollout.path = rollout.history.pop()
            rollout.weights = weights_of(rollout.path)
        self._retarget(rollout.model.name, **changes)
        self._changed("rollout_failed", rollout.model.name, reason=reason, back_to=rollout.path)

    # -- commands -------------------------------------------------------------------------------------------

    def begin_rollout(self, model_name: str, path: str, strategy: RolloutStrategy, canary_percent: int) -> Rollout:
        """New weights get a new epoch; the same weights again (a canary lifted) go on with the rollout's own. New
        files at the same path (a checkpoint overwritten in place) are new weights."""
        rollout, epoch = self.rollouts[model_name], self.targets[model_name][Pool.ROUTED].epoch
        if self.is_new_weights(model_name, path) or rollout.phase is RolloutPhase.FAILED:
            rollout.history.append((epoch, rollout.path))
            epoch = max([w.epoch for w in self.workers] + [epoch]) + 1
            rollout.path, rollout.weights = path, weights_of(path)
        self._retarget(model_name, epoch=epoch, strategy=strategy, canary_percent=canary_percent)
        rollout.error = ""
        rollout.phase = RolloutPhase.ROLLING
        self._changed("rollout_started", model_name, epoch=epoch, path=path, strategy=str(strategy),
                      canary_percent=canary_percent)  # fmt: skip
        return rollout

    def is_new_weights(self, model_name: str, path: str) -> bool:
        return weights_of(path) != self.rollouts[model_name].weights

    def roll_back(self, model_name: str, strategy: RolloutStrategy) -> Rollout:
        """Back to the weights before the latest rollout (the old workers are kept if they still run)."""
        rollout = self.rollouts[model_name]
        epoch, rollout.path = rollout.history.pop()
        rollout.weights = weights_of(rollout.path)
        self._retarget(model_name, epoch=epoch, strategy=strategy, canary_percent=0)
        rollout.error = ""
        rollout.phase = RolloutPhase.ROLLING
        self._changed("rollback_started", model_name, epoch=epoch, path=rollout.path)
        return rollout

    def status(self, model_name: str) -> RolloutStatus:
        return self.rollouts[model_name].status(self.targets[model_name][Pool.ROUTED])

    # -- health ---------------------------------------------------------------------------------------------

    def is_rolling(self, model_name: str) -> bool:
        return self.rollouts[model_name].phase.in_progress

    def watched_children(self, serving_announced: bool) -> list[Child]:
        """The workers whose loops the systemd watchdog waits on: all of them until the daemon first serves, then
        those that have served (a rollout's new worker may take minutes to load its weights; a crashed worker's
        restart may not)."""
        return [w.child for w in self.workers if w.has_served or not serving_announced]


def weights_of(path: str) -> str:
    """What the weights at `path` are now: their generation for files, the name itself for a built-in model."""
    return model_generation(Path(path)) if Path(path).exists() else path
