"""A discrete-time cluster of workers doing continuous batching, fed by a frontend queue.

Each worker steps back to back while it has work: a step computes one token for every decoding sequence and then
prefill chunks (first come, first served) up to the token budget, and takes base_ms + per_token_ms * tokens. A
request's first token comes at the end of the step that finishes its prefill, so its TTFT is the frontend queue
wait plus its prefill. A worker takes a request from the frontend queue (the oldest) when it has a free slot and
its unfinished prefill fits in one step: the router sends work where it can start now, as a least-loaded router.

Workers are starting (loading, billed, not serving), standby (warm, billed, not routed), serving, or draining
(billed, taking no new work, retired when empty). The control loop runs every `tick_s` at tick boundaries, and the
daemon's own reconciler (daemon.reconcile) moves the workers toward the counts it asks for, one action per supervisor
tick. A worker's projected TTFT is the scheduler's projection (gpu_runtime.latency.prefill_seconds) over its step
cost: only the clock, the arrivals and the engine's step times are simulated.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from common.autoscale_policy import StepCost, WorkerSnapshot
from common.lanes import WorkerState
from daemon.reconcile import (
    DemoteWorkers,
    DrainWorkers,
    PlannedWorker,
    PoolActual,
    PoolTarget,
    PromoteWorkers,
    StartWorker,
    StopWorkers,
    reconcile,
)
from gpu_runtime.latency import StepTimeModel, prefill_seconds

ACTIONS_PER_TICK = 10  # the supervisor reconciles every 0.1 s (daemon.supervisor), the autoscaler ticks every 1 s
_GROUPS = 256  # groups the simulated machines have: never the bound (max_workers is)


@dataclass(slots=True)
class Request:
    arrival: float
    prompt: int
    output: int
    prefill_left: int = 0
    first_token_at: float | None = None


@dataclass(frozen=True, slots=True)
class ServingOverheads:
    """What a serving stack adds to the engine's step time (sim_vs_daemon.py measures them on the daemon): each
    request's way in and its first token's way out, the scheduler loop's share of each step, fixed and per
    sequence in it, and how much slower than the fitted model its steps run (a machine shared with other work).
    None by default: the autoscaling comparison is between policies on the same engine."""

    request_s: float = 0.0
    step_ms: float = 0.0
    per_sequence_ms: float = 0.0
    step_scale: float = 1.0


@dataclass(eq=False, slots=True)
class Worker:
    slot: int
    started_at: float
    ready_at: float
    standby: bool = False
    draining: bool = False
    clock: float = 0.0  # when its next step may start
    prefilling: deque = field(default_factory=deque)
    decode_ends: list = field(default_factory=list)  # heap of the decode-step index each decoding request ends at
    decode_steps: int = 0
    busy_s: float = 0.0  # stepping time since the last control tick

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decode_ends)

    @property
    def prefill_backlog(self) -> int:
        return sum(r.prefill_left for r in self.prefilling)

    def state(self, now: float) -> WorkerState:
        if self.draining:
            return WorkerState.DRAINING
        if self.ready_at > now:
            return WorkerState.STARTING
        return WorkerState.STANDBY if self.standby else WorkerState.SERVING


class Cluster:
    def __init__(self, model: StepCost, max_num_seqs: int, max_num_batched_tokens: int, warmup_s: float,
                 overheads: ServingOverheads | None = None):  # fmt: skip
        self.model = model
        self.overheads = overheads or ServingOverheads()
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.warmup_s = warmup_s
        self.workers: list[Worker] = []
        self.queue: deque[Request] = deque()
        self.ttfts: list[tuple[float, float]] = []  # (first token time, ttft) in the order they came
        self.retired_worker_seconds = 0.0
        self._step_time = StepTimeModel()  # the scheduler's model of the same step cost, in seconds
        self._step_time.coefficients = (model.base_ms / 1e3, model.per_token_ms / 1e3, 0.0)

    # ----- membership -----
    def add_warm(self, now: float, standby: bool = False) -> None:
        self.workers.append(Worker(self._free_slot(), started_at=now, ready_at=now, standby=standby, clock=now))

    def start(self, now: float, standby: bool = False, slot: int | None = None) -> None:
        slot = self._free_slot() if slot is None else slot
        self.workers.append(Worker(slot, started_at=now, ready_at=now + self.warmup_s, standby=standby, clock=now))

    def _free_slot(self) -> int:
        held = {w.slot for w in self.workers}
        return next(slot for slot in range(_GROUPS) if slot not in held)

    def serving(self, now: float) -> list[Worker]:
        return [w for w in self.workers if w.ready_at <= now and not w.standby and not w.draining]

    def starting(self, now: float, standby: bool) -> list[Worker]:
        return [w for w in self.workers if w.ready_at > now and w.standby == standby and not w.draining]

    def standbys(self, now: float) -> list[Worker]:
        return [w for w in self.workers if w.ready_at <= now and w.standby and not w.draining]

    def billed(self) -> int:
        return len(self.workers)

    def actuate(self, now: float, desired: int, standby: int) -> None:
        """The daemon's side of a scale command: `desired` workers serving or starting toward serving and
        `standby` warm standbys, reached by daemon.reconcile one action per supervisor tick."""
        target = PoolTarget(0, max(1, desired), standby)
        for _ in range(ACTIONS_PER_TICK):
            held = {w.slot for w in self.workers}
            planned = tuple(PlannedWorker(str(w.slot), 0, w.state(now), w.slot, w.standby) for w in self.workers)
            actual = PoolActual(planned, spare_slots=tuple(s for s in range(_GROUPS) if s not in held))
            action = reconcile(target, actual, now)
            if not self._carry_out(action, now):
                return

    def _carry_out(self, action, now: float) -> bool:
        """One action's effect, at once (a start begins loading); False for one that does nothing (Wait, Done)."""
        chosen = [w for w in self.workers if str(w.slot) in getattr(action, "worker_ids", ())]
        if isinstance(action, StartWorker):
            self.start(now, action.standby, action.slot)
        elif isinstance(action, PromoteWorkers):
            for worker in chosen:
                worker.standby = False  # one still loading serves once warm
        elif isinstance(action, DemoteWorkers):
            for worker in chosen:
                worker.standby = True  # a routing flip back: its streams finish on it
        elif isinstance(action, DrainWorkers):
            for worker in chosen:
                worker.standby, worker.draining = False, True
                if not worker.running:
                    self._retire(worker, now)
        elif isinstance(action, StopWorkers):
            for worker in chosen:
                self._retire(worker, now)  # still loading: nothing runs there
        else:
            return False
        return True

    def _retire(self, worker: Worker, now: float) -> None:
        self.retired_worker_seconds += now - worker.started_at
        self.workers.remove(worker)

    def worker_seconds(self, now: float) -> float:
        return self.retired_worker_seconds + sum(now - w.started_at for w in self.workers)

    # ----- load indicators -----
    def projected_ttft_s(self, worker: Worker, now: float, prompt_tokens: float) -> float:
        """A new prompt's wait on this worker: the rest of its current step, then the scheduler's projection of
        the prefill ahead of it plus its own beside the decodes."""
        ahead = worker.prefill_backlog + round(prompt_tokens)
        return max(0.0, worker.clock - now) + prefill_seconds(self._step_time, self.budget, len(worker.decode_ends),
                                                              ahead)  # fmt: skip

    def snapshots(self, now: float, prompt_tokens: float) -> list[WorkerSnapshot]:
        return [
            WorkerSnapshot(
                self.projected_ttft_s(w, now, prompt_tokens), len(w.decode_ends), len(w.prefilling), self.max_num_seqs
            )
            for w in self.serving(now)
        ]

    def queue_wait_s(self, now: float) -> float:
        return now - self.queue[0].arrival if self.queue else 0.0

    # ----- time -----
    def advance(self, arrivals: deque[Request], until: float) -> None:
        """Run every worker's steps that start before `until`, taking the arrivals due by then."""
        order = itertools.count()
        heap = []
        for w in self.workers:
            if w.ready_at < until and (not w.standby or w.running):
                w.clock = max(w.clock, w.ready_at)
                heap.append((w.clock, next(order), w))
        heapq.heapify(heap)
        while heap:
            at, _, w = heapq.heappop(heap)
            if at >= until:
                continue
            while arrivals and arrivals[0].arrival <= at:
                self.queue.append(arrivals.popleft())
            if not w.draining and not w.standby:
                self._take(w)
            if not w.running:
                if w.standby:
                    continue  # a demoted worker whose streams ended: warm, not routed
                if w.draining:
                    self._retire(w, at)
                    continue
                nxt = arrivals[0].arrival if arrivals else until
                w.clock = max(at, min(nxt, until))
                if w.clock < until:
                    heapq.heappush(heap, (w.clock, next(order), w))
                continue
            w.clock = at + self._step(w, at)
            heapq.heappush(heap, (w.clock, next(order), w))
        for w in self.workers:
            if w.clock < until and w.ready_at <= until:
                w.clock = until  # idle to the tick's end
        while arrivals and arrivals[0].arrival < until:
            self.queue.append(arrivals.popleft())

    def _take(self, w: Worker) -> None:
        while self.queue and w.running < self.max_num_seqs and w.prefill_backlog < self.budget:
            request = self.queue.popleft()
            request.prefill_left = request.prompt
            w.prefilling.append(request)

    def _step(self, w: Worker, at: float) -> float:
        decodes = len(w.decode_ends)
        room = max(0, self.budget - decodes)
        prefilled = []
        tokens, sequences = decodes, decodes
        for request in w.prefilling:
            if room <= 0:
                break
            sequences += 1
            chunk = min(room, request.prefill_left)
            request.prefill_left -= chunk
            room -= chunk
            tokens += chunk
            if request.prefill_left == 0:
                prefilled.append(request)
        extra = self.overheads.step_ms + self.overheads.per_sequence_ms * sequences
        seconds = (self.overheads.step_scale * self.model.step_ms(tokens) + extra) / 1e3
        end = at + seconds
        w.busy_s += seconds
        if decodes:
            w.decode_steps += 1
            while w.decode_ends and w.decode_ends[0] <= w.decode_steps:
                heapq.heappop(w.decode_ends)
        for request in prefilled:
            w.prefilling.popleft()
            request.first_token_at = end + self.overheads.request_s
            self.ttfts.append((request.first_token_at, request.first_token_at - request.arrival))
            if request.output > 1:  # the first token came with the prefill
                heapq.heappush(w.decode_ends, w.decode_steps + request.output - 1)
        return seconds

    def take_busy_fractions(self, now: float, tick_s: float) -> list[float]:
        """Each serving worker's share of the last tick spent stepping (a GPU-utilisation gauge), then reset."""
        fractions = [min(1.0, w.busy_s / tick_s) for w in self.serving(now)]
        for w in self.workers:
            w.busy_s = 0.0
        return fractions
