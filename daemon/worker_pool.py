"""The daemon's worker set: every scheduler process, its slot, weights, epoch and state, and each model's rollout.

One writer changes what the set should be (a rollout command, a rollback, a failed rollout going back); `tick`
moves the actual processes towards it, one action per pool of a model at a time (daemon.rollout_plan decides which;
with prefill workers, they and the routed workers are two pools, each on the groups of its role), and
notices what the processes did: warmed up (serving), exited after draining (retired), crashed (restarted with
backoff, as before rollouts existed: crash restart is the plan's "keep target_count workers" too).
"""

from __future__ import annotations

import collections
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.exit_codes import EXIT_CONFIG_ERROR
from common.generation import model_generation
from daemon.child_specs import Slot, slots_of, worker_spec
from daemon.children import Child
from daemon.config import ModelSpec, ServeConfig
from daemon.rollout_plan import (
    DemoteWorkers,
    Done,
    DrainWorkers,
    PlannedWorker,
    PromoteWorkers,
    StartWorker,
    StopWorkers,
    Stuck,
    Target,
    next_action,
)
from daemon.scaling_plan import next_scaling_action
from frontend.control_messages import RolloutStatus, RolloutStrategy, WorkerInfo, WorkerState
from gpu_runtime.worker.spec import WorkerSpec

MAX_CONSECUTIVE_FAILURES = 8  # then the daemon (or, for a rollout's worker, the rollout) gives up
_EVENTS_KEPT = 32
_DRAIN_GRACE_S = 30.0
_ROLLOUT_START_ATTEMPTS = 3  # past the drain timeout, a draining worker that has not exited is stopped


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
    has_served: bool = False  # it got to its loop once: from then on, a restart is a crash restart
    configured: bool = False  # one of the daemon's own configuration, started with it
    standby_when_warm: bool = False  # a pre-warmed standby: loaded and warm, but not routed until promoted
    started_at: float = 0.0
    warmup_seconds: float = 0.0  # from its start to its loop, measured (the autoscaler's horizon)

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.spec.worker_id, self.model_name, self.slot.group, self.slot.devices,
                          self.spec.input_address, self.epoch, self.path, self.state,
                          role=self.slot.role, pid=self.child.pid or 0, warmup_seconds=self.warmup_seconds,
                          standby=self.standby_when_warm and self.state != WorkerState.SERVING)  # fmt: skip


@dataclass(eq=False)
class Rollout:
    """A model's target weights and how to get there; epoch 0 is the configuration's own."""

    model: ModelSpec
    target_count: int
    epoch: int = 0
    path: str = ""
    weights: str = ""  # what the files at `path` were when this target was set (weights_of)
    strategy: RolloutStrategy = RolloutStrategy.SURGE
    canary_percent: int = 0
    standby_count: int = 0  # pre-warmed workers kept beside the serving ones (min_standby)
    # Of target_count, the prefill pool's (disaggregated serving), and its own standbys; the rest are the routed
    # pool's (decode and mixed workers), which standby_count is for.
    prefill_count: int = 0
    prefill_standby: int = 0
    history: list[tuple[int, str]] = field(default_factory=list)  # (epoch, path) of the targets before this one
    phase: str = "none"
    error: str = ""
    events: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=_EVENTS_KEPT))

    def target(self, count: int | None = None, strategy: RolloutStrategy | None = None) -> Target:
        """Where the rollout goes: the model's workers, or `count` of one pool's (with its own strategy)."""
        count = self.target_count if count is None else count
        return Target(self.epoch, strategy or self.strategy, count, self.canary_percent)

    def pools(self) -> list[tuple[bool, int, int]]:
        """(prefill, serving, standby) of each pool: the routed workers, and the prefill ones if there are any."""
        pools = [(False, self.target_count - self.prefill_count, self.standby_count)]
        if self.prefill_count:
            pools.append((True, self.prefill_count, self.prefill_standby))
        return pools

    def status(self) -> RolloutStatus:
        previous = self.history[-1][1] if self.history else ""
        return RolloutStatus(self.model.name, self.phase, self.epoch, self.path, previous, self.strategy,
                             self.canary_percent, list(self.events), self.error)  # fmt: skip


class WorkerPool:
    def __init__(self, config: ServeConfig, runtime_dir: Path, log):
        self.config = config
        self.runtime_dir = runtime_dir
        self.log = log
        self.slots = slots_of(config)
        self.workers: list[Worker] = []
        self.rollouts: dict[str, Rollout] = {}
        self.version = 0  # of the set as the frontend sees it: bumped at every change
        for model in config.served_models():
            home = [slot for slot in self.slots if slot.owner == model.name]
            path = model.path or model.name
            prefill, standby = sum(slot.role == "prefill" for slot in home), config.autoscale.min_standby
            self.rollouts[model.name] = Rollout(model, target_count=len(home), path=path, weights=weights_of(path),
                                                standby_count=standby, prefill_count=prefill,
                                                prefill_standby=standby if prefill else 0)  # fmt: skip
            for slot in home:
                self._add_worker(model, slot, 0, path, configured=True)

    # -- the set as others see it -----------------------------------------------------------------------------

    def infos(self) -> list[WorkerInfo]:
        return [worker.info() for worker in self.workers]

    def statuses(self) -> list[RolloutStatus]:
        return [rollout.status() for rollout in self.rollouts.values()]

    def spare_slots(self, model_name: str, strategy: RolloutStrategy, prefill: bool | None = None) -> list[int]:
        """Free slots a new worker of the model may take: its own groups, and for surge the unused spares; with
        `prefill`, only those of the prefill pool's role (True) or of the routed pool's (False)."""
        held = {worker.slot.index for worker in self.workers}
        allowed = (model_name, None) if strategy == RolloutStrategy.SURGE else (model_name,)
        return [
            s.index for s in self.slots
            if s.index not in held and s.owner in allowed and not s.failed
            and (prefill is None or (s.role == "prefill") == prefill)
        ]  # fmt: skip

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
        child = Child(
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

    @staticmethod
    def _start(worker: Worker) -> None:
        worker.child.start()
        worker.started_at = time.monotonic()

    def stop_all(self, timeout: float) -> None:
        for worker in self.workers:
            worker.child.signal(signal.SIGTERM)
        for worker in self.workers:
            worker.child.stop(timeout=timeout)

    # -- the loop -------------------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Observes every worker, then takes each model's next rollout action. Raises CannotServe when a worker
        of the daemon's own configuration cannot start."""
        for worker in list(self.workers):
            self._observe(worker, now)
        for rollout in self.rollouts.values():
            if rollout.phase in ("rolling", "rolling-back", "canary"):
                self._advance(rollout)
            else:
                self._scale(rollout)

    def _observe(self, worker: Worker, now: float) -> None:
        child = worker.child
        if child.process is None:
            if child.restart_at is not None and now >= child.restart_at:
                self.log.info("restarting", child=child.name, restarts=child.num_restarts)
                child.start()
                worker.state = WorkerState.STARTING
                self._changed()
            return
        code = child.poll()
        if code is None:
            if worker.state == WorkerState.STARTING and child.heartbeat_age(time.time()) is not None:
                worker.state = WorkerState.STANDBY if worker.standby_when_warm else WorkerState.SERVING
                if not worker.has_served:
                    worker.has_served, worker.warmup_seconds = True, round(now - worker.started_at, 3)
                self._changed(f"worker_{worker.state}", worker.model_name, worker=worker.spec.worker_id,
                              epoch=worker.epoch, warmup_s=worker.warmup_seconds)  # fmt: skip
            elif worker.state == WorkerState.DRAINING:
                self._enforce_drain_timeout(worker, now)
            return
        if worker.state == WorkerState.DRAINING:
            self.workers.remove(worker)
            self._changed("worker_retired", worker.model_name, worker=worker.spec.worker_id, exit_code=code)
            return
        rollout = self.rollouts[worker.model_name]
        failures = child.consecutive_failures + 1
        # A worker added later (a rollout's, the autoscaler's) that crashes before it ever served is not retried
        # for minutes: its weights or its group cannot serve.
        never_served = not worker.configured and not worker.has_served and failures >= _ROLLOUT_START_ATTEMPTS
        gives_up = code == EXIT_CONFIG_ERROR or failures > MAX_CONSECUTIVE_FAILURES or never_served
        if gives_up and worker.configured and rollout.epoch == 0:
            self.log.error("configuration_error" if code == EXIT_CONFIG_ERROR else "cannot_serve", child=child.name,
                           exit_code=code)  # fmt: skip
            raise CannotServe(code if code == EXIT_CONFIG_ERROR else 1)
        if gives_up:
            self.workers.remove(worker)
            reason = f"worker {worker.spec.worker_id} on {worker.path} exited with {code}"
            if rollout.phase in ("rolling", "rolling-back", "canary") and worker.epoch == rollout.epoch:
                self._fail_rollout(rollout, reason)  # the new weights cannot serve: back to the ones before
            else:  # the group cannot serve (a spare GPU that fails): no worker is started there again
                worker.slot.failed = True
                self._changed("group_failed", worker.model_name, reason=reason, devices=worker.slot.devices)
            return
        delay = child.schedule_restart(now)
        worker.state = WorkerState.FAILED
        self._changed()
        self.log.warning("child_exited", child=child.name, exit_code=code, restart_in_s=delay)

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

    def _advance(self, rollout: Rollout) -> None:
        """One action for each pool of the model (its routed workers, and its prefill ones), each on the free groups
        of its role, so that a rollout leaves the pools as it found them; settled once both are."""
        mine = [w for w in self.workers if w.model_name == rollout.model.name]
        actions = []
        for prefill, count, _standby in rollout.pools():
            members = [w for w in mine if (w.slot.role == "prefill") == prefill]
            planned = [PlannedWorker(w.spec.worker_id, w.epoch, w.state, w.slot.index) for w in members]
            free = self.spare_slots(rollout.model.name, rollout.strategy, prefill)
            # Without a spare prefill group, the prefill pool goes one group at a time: while one is down its
            # prompts are computed by the routed workers, so nobody waits.
            strategy = RolloutStrategy.IN_PLACE if prefill and not free else rollout.strategy
            actions.append((members, next_action(rollout.target(count, strategy), planned, free)))
        for _members, action in actions:
            if isinstance(action, Stuck):
                self._fail_rollout(rollout, action.reason)
                return
        for members, action in actions:
            self._act(rollout, members, action)
        if all(isinstance(action, Done) for _, action in actions):
            settled = {"rolling": "canary" if rollout.target().is_canary else "done", "rolling-back": "failed"}
            if rollout.phase in settled:
                rollout.phase = settled[rollout.phase]
                self._changed(f"rollout_{rollout.phase}", rollout.model.name, epoch=rollout.epoch, path=rollout.path)

    def _scale(self, rollout: Rollout) -> None:
        """Between rollouts: the serving and standby counts the autoscaler (and min_standby) ask for, for each pool
        of the model apart (its prefill workers, and the routed ones), each on the free groups of its role."""
        mine = [w for w in self.workers if w.model_name == rollout.model.name and w.epoch == rollout.epoch]
        for prefill, serving, standby in rollout.pools():
            members = [w for w in mine if (w.slot.role == "prefill") == prefill]
            planned = [PlannedWorker(w.spec.worker_id, w.epoch, w.state, w.slot.index, w.standby_when_warm)
                       for w in members]  # fmt: skip
            free = self.spare_slots(rollout.model.name, RolloutStrategy.SURGE, prefill)
            self._act(rollout, members, next_scaling_action(serving, standby, planned, free))

    def _act(self, rollout: Rollout, members: list[Worker], action) -> None:
        """Carries out one pool's action (a rollout's or the scaling plan's); Wait and Done do nothing."""
        if isinstance(action, StartWorker):
            worker = self._add_worker(rollout.model, self.slots[action.slot], rollout.epoch, rollout.path)
            worker.standby_when_warm = action.standby
            self._start(worker)
            self._changed("worker_starting", rollout.model.name, worker=worker.spec.worker_id, epoch=rollout.epoch,
                          path=rollout.path, standby=action.standby, role=worker.slot.role,
                          devices=worker.slot.devices)  # fmt: skip
        elif isinstance(action, PromoteWorkers):
            for worker in [w for w in members if w.spec.worker_id in action.worker_ids]:
                worker.standby_when_warm = False  # one still loading serves once warm; a restart serves too
                if worker.state == WorkerState.STANDBY:
                    worker.state = WorkerState.SERVING
                self._changed("worker_promoted", rollout.model.name, worker=worker.spec.worker_id)
        elif isinstance(action, DemoteWorkers):
            for worker in [w for w in members if w.spec.worker_id in action.worker_ids]:
                worker.state, worker.standby_when_warm = WorkerState.STANDBY, True
                self._changed("worker_demoted", rollout.model.name, worker=worker.spec.worker_id)
        elif isinstance(action, DrainWorkers):
            for worker in [w for w in members if w.spec.worker_id in action.worker_ids]:
                self._drain(worker)
        elif isinstance(action, StopWorkers):
            for worker in [w for w in members if w.spec.worker_id in action.worker_ids]:
                self._stop_unready(worker)

    def scale(self, model_name: str, serving: int, standby: int, reason: str, prefill: bool = False) -> None:
        """The autoscaler's counts for one pool of a model (its prefill workers, or the routed ones); bounded by
        its groups, the spares included."""
        rollout = self.rollouts[model_name]
        if prefill and not rollout.prefill_count:
            return  # a model without prefill workers has no such pool to scale
        serving = max(1, min(serving, len(self.slots)))
        routed, routed_standby = rollout.target_count - rollout.prefill_count, rollout.standby_count
        pool = (rollout.prefill_count, rollout.prefill_standby) if prefill else (routed, routed_standby)
        if (serving, standby) == pool:
            return
        self._changed("scale", model_name, serving=serving, standby=standby, reason=reason,
                      role="prefill" if prefill else "routed", previous_serving=pool[0])  # fmt: skip
        if prefill:
            rollout.prefill_count, rollout.prefill_standby = serving, standby
            rollout.target_count = routed + serving
        else:
            rollout.target_count, rollout.standby_count = serving + rollout.prefill_count, standby

    def _drain(self, worker: Worker) -> None:
        """No new requests from now on (the frontend tells the worker, which exits once its streams end)."""
        worker.state, worker.draining_since = WorkerState.DRAINING, time.monotonic()
        self._changed("worker_draining", worker.model_name, worker=worker.spec.worker_id, epoch=worker.epoch)

    def _stop_unready(self, worker: Worker) -> None:
        """A worker that serves nobody yet stops at once: it retires when it exits (now, if it is not running)."""
        worker.state = WorkerState.DRAINING
        worker.draining_since = time.monotonic()
        if worker.child.process is None:  # crashed, waiting for its restart
            self.workers.remove(worker)
            self._changed("worker_retired", worker.model_name, worker=worker.spec.worker_id, exit_code=None)
            return
        worker.child.signal(signal.SIGTERM)
        self._changed("worker_stopping", worker.model_name, worker=worker.spec.worker_id, epoch=worker.epoch)

    def _fail_rollout(self, rollout: Rollout, reason: str) -> None:
        rollout.error = reason
        rollout.phase = "rolling-back"
        if rollout.history:
            rollout.epoch, rollout.path = rollout.history.pop()
            rollout.weights = weights_of(rollout.path)
        rollout.canary_percent = 0
        self._changed("rollout_failed", rollout.model.name, reason=reason, back_to=rollout.path)

    # -- commands -------------------------------------------------------------------------------------------

    def begin_rollout(self, model_name: str, path: str, strategy: RolloutStrategy, canary_percent: int) -> Rollout:
        """New weights get a new epoch; the same weights again (a canary lifted) go on with the rollout's own. New
        files at the same path (a checkpoint overwritten in place) are new weights."""
        rollout = self.rollouts[model_name]
        if self.is_new_weights(model_name, path) or rollout.phase == "failed":
            rollout.history.append((rollout.epoch, rollout.path))
            rollout.epoch = max([w.epoch for w in self.workers] + [rollout.epoch]) + 1
            rollout.path, rollout.weights = path, weights_of(path)
        rollout.strategy = strategy
        rollout.canary_percent = canary_percent
        rollout.error = ""
        rollout.phase = "rolling"
        self._changed("rollout_started", model_name, epoch=rollout.epoch, path=path, strategy=str(strategy),
                      canary_percent=canary_percent)  # fmt: skip
        return rollout

    def is_new_weights(self, model_name: str, path: str) -> bool:
        return weights_of(path) != self.rollouts[model_name].weights

    def roll_back(self, model_name: str, strategy: RolloutStrategy) -> Rollout:
        """Back to the weights before the latest rollout (the old workers are kept if they still run)."""
        rollout = self.rollouts[model_name]
        rollout.epoch, rollout.path = rollout.history.pop()
        rollout.weights = weights_of(rollout.path)
        rollout.strategy = strategy
        rollout.canary_percent = 0
        rollout.error = ""
        rollout.phase = "rolling"
        self._changed("rollback_started", model_name, epoch=rollout.epoch, path=rollout.path)
        return rollout

    # -- health ---------------------------------------------------------------------------------------------

    def is_rolling(self, model_name: str) -> bool:
        return self.rollouts[model_name].phase in ("rolling", "rolling-back")

    def watched_children(self, serving_announced: bool) -> list[Child]:
        """The workers whose loops the systemd watchdog waits on: all of them until the daemon first serves, then
        those that have served (a rollout's new worker may take minutes to load its weights; a crashed worker's
        restart may not)."""
        return [w.child for w in self.workers if w.has_served or not serving_announced]


def weights_of(path: str) -> str:
    """What the weights at `path` are now: their generation for files, the name itself for a built-in model."""
    return model_generation(Path(path)) if Path(path).exists() else path
