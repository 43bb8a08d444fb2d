"""The frontend's view of its workers: each one's state, load and slots, and the one function that picks a worker.

A worker takes new requests when the daemon's worker set says it is serving and its link is live (ready and
reporting): the daemon's word is the only readiness source; a SchedulerReady says what the worker is and that it
is alive, never that it may be routed. Routing goes by the sooner projected first token (see `routing_key`), among
the workers the worker set routes a request to (its rollout's weights, a canary's share); for a prompt, that
includes computing what of it is not cached on the worker (`prefix_cost`, from the workers' KV events).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq.asyncio

from common.lanes import Pool, Role, WorkerState
from frontend.control_messages import WorkerInfo, WorkerSet
from frontend.prefix_index import PrefixIndex, PromptPages
from frontend.spec import SchedulerAddress
from frontend.worker_set_view import WorkerSetView
from gpu_runtime.ipc.messages import LoadReport, SchedulerReady, StepOutputs
from gpu_runtime.ipc.peer_auth import Session

_MIN_STEP_S = 0.001  # a step's least cost in the routing key, for a worker with no step time reported yet
# A prompt token's cost in the routing key until some worker's step-time model is fitted (its first few steps): a
# small model's on a CPU, a large one's on a GPU, both within a few times of it.
_DEFAULT_TOKEN_S = 1e-4
# Past this imbalance of requests in flight, prefix-aware routing routes by load alone (SGLang's cache-aware router
# does the same): a worker that holds many conversations' pages would otherwise keep them, its queue growing, for as
# long as their prefill elsewhere costs more than its wait, while another worker idles. Imbalanced means the busiest
# worker has more than _BALANCE_RELATIVE times, and over half a batch more than, the least busy one (a quarter of a
# batch broke too many conversations off their pages: the multi-turn benchmark's --quick p50 went from 0.20x to 0.94x).
_BALANCE_RELATIVE = 2.0


@dataclass(eq=False)
class SchedulerState:
    """One worker as the frontend knows it: the daemon's state for it, its link's liveness, its load and slots."""

    address: SchedulerAddress
    # Its place in the daemon's worker set (WorkerInfo.state): only SERVING workers get new requests.
    worker_state: WorkerState = WorkerState.SERVING
    epoch: int = 0
    warmup_seconds: float = 0.0
    standby: bool = False  # a pre-warmed standby (or one starting): not routed until promoted
    # Which part of a request it runs: the worker set's word, or its SchedulerReady's before the set named it.
    role: Role = Role.MIXED
    socket: zmq.asyncio.Socket | None = None
    ready: SchedulerReady | None = None  # None while down or starting: its metadata, and that it is alive
    load: LoadReport | None = None
    load_received_at: float = 0.0
    heard_at: float = 0.0  # monotonic time of its latest ready, outputs or load report
    unresponsive: bool = False  # ready, but silent for longer than the liveness threshold
    requests: set[str] = field(default_factory=set)  # the requests running here (their streams' ids)
    # Slots given out but not yet filled: admission's pick on its way to submit(), or a disaggregated request's
    # decode worker, held while its prompt runs on a prefill worker.
    reserved: int = 0
    num_routed: int = 0  # requests admission gave it, ever: the last tie-break, so that idle workers take turns
    monitor_task: asyncio.Task | None = None
    # The nonce of the hello on its current connection, and the session that hello and its ready opened (made when
    # the ready is taken): what the link seals its frames to it with, and checks the seals of its frames with.
    hello_nonce: bytes = b""
    session: Session | None = None
    # Outputs that came before this frontend had the scheduler's proven ready (sealed on the session its hello
    # opened, which needs the ready's incarnation to check), each with its frame and seal. Checked and delivered
    # once a genuine ready names their sender.
    unproven: collections.deque[tuple[StepOutputs, bytes, bytes]] = field(
        default_factory=lambda: collections.deque(maxlen=256)
    )

    @property
    def is_ready(self) -> bool:
        return self.ready is not None

    @property
    def is_live(self) -> bool:
        """Ready and making progress."""
        return self.ready is not None and not self.unresponsive

    @property
    def takes_new_requests(self) -> bool:
        return self.is_live and self.worker_state == WorkerState.SERVING

    @property
    def pool(self) -> Pool:
        return Role(self.role).pool

    @property
    def generation(self) -> str:
        return self.ready.generation if self.ready is not None else ""

    @property
    def projected_ttft_seconds(self) -> float:
        return self.load.projected_ttft_seconds if self.load is not None else 0.0

    @property
    def outstanding(self) -> int:
        """Slots taken here: requests running and slots given out for requests on their way."""
        return len(self.requests) + self.reserved

    def reserve(self) -> None:
        self.reserved += 1
        self.num_routed += 1

    def unreserve(self) -> None:
        self.reserved = max(0, self.reserved - 1)

    @property
    def routing_key(self) -> tuple[float, int, int]:
        """The sooner projected first token, then fewer requests (in flight, then ever: idle workers take turns, so
        that the first prompts of a few shared prefixes spread over them). The projection is as old as the latest
        load report, so each request sent here since counts as one more prompt ahead of the next: otherwise a burst
        would all go to whichever worker looked fastest before it began. A first token takes at least one step,
        so the projection counts one more (its mean step, at least _MIN_STEP_S): an idle worker projecting 0 s, or
        one that has sent no load report yet, would otherwise stay at 0 s however many requests went to it since."""
        outstanding = self.outstanding
        reported = self.load.num_running + self.load.num_waiting if self.load is not None else 0
        step_s = max(self.load.mean_step_ms / 1e3 if self.load is not None else 0.0, _MIN_STEP_S)
        wait_s = (self.projected_ttft_seconds + step_s) * (1 + max(0, outstanding - reported))
        return wait_s, outstanding, self.num_routed

    @property
    def seconds_per_token(self) -> float:
        """A prompt token's cost here: by the step-time model its load reports carry, or until that is fitted (its
        first few steps) its steps' time over the tokens they computed (an upper bound: each step's fixed cost is in
        it); 0 before it ran a step."""
        load = self.load
        if load is None:
            return 0.0
        if load.seconds_per_token > 0:
            return load.seconds_per_token
        num_steps = sum(load.iteration_token_counts)
        return load.mean_step_ms / 1e3 * num_steps / load.iteration_tokens_sum if load.iteration_tokens_sum else 0.0


class WorkerView:
    """Every worker the frontend knows, and the daemon's worker set they belong to."""

    def __init__(self, addresses: list[SchedulerAddress], initial_state: WorkerState):
        # Before the daemon's first WorkerSet: `initial_state` (STARTING when a daemon will say, SERVING for a
        # frontend without one).
        self.schedulers = [SchedulerState(address, initial_state) for address in addresses]
        self.worker_set = WorkerSetView()  # the daemon's latest WorkerSet, as routing reads it
        self.prefix_index = PrefixIndex()  # which prompt pages each worker holds, from its KV events
        self.prefix_weight = 1.0  # the prefill of uncached tokens in the routing key (0: load alone)

    def find(self, worker_id: str) -> SchedulerState | None:
        return next((s for s in self.schedulers if s.address.worker_id == worker_id), None)

    def ready(self, model_name: str, pool: Pool = Pool.ROUTED) -> list[SchedulerState]:
        """The model's workers of `pool` that take new requests: serving, ready and live."""
        return [s for s in self.schedulers
                if s.address.model_name == model_name and s.takes_new_requests and s.pool is pool]  # fmt: skip

    def routed(self, model_name: str, draw: float) -> list[SchedulerState]:
        """The workers a new request may go to: the newest serving weights, or a canary's share (`draw` in [0, 1)
        is the request's own)."""
        return self.worker_set.route(model_name, self.ready(model_name), draw)

    def expects_capacity(self, model_name: str) -> bool:
        """True while a rollout of the model is under way: a moment with no serving worker is planned, not lost."""
        return self.worker_set.is_rolling(model_name)

    def pick(
        self,
        model_name: str,
        *,
        pool: Pool = Pool.ROUTED,
        draw: float = 0.0,
        generation: str | None = None,
        exclude: SchedulerState | None = None,
        has_room: Callable[[SchedulerState], bool] | None = None,
        prompt: PromptPages | None = None,
    ) -> SchedulerState | None:
        """The one routing decision: the worker a request (or the next part of one) goes to, or None.

        Routed workers as the worker set splits them by `draw`; with `generation`, only workers of those weights
        (a prefill worker must match its decode worker's: pages of other weights are worthless there); never
        `exclude` (the worker a migration leaves); only those `has_room` lets through. Then the soonest first
        token: `routing_key`, and with a `prompt` the prefill of what is not cached there (`prefix_cost`)."""
        if generation is not None:
            candidates = [s for s in self.ready(model_name, pool) if s.generation == generation]
        else:
            candidates = self.routed(model_name, draw) if pool is Pool.ROUTED else self.ready(model_name, pool)
        candidates = [s for s in candidates if s is not exclude and (has_room is None or has_room(s))]
        if prompt is None or self.prefix_weight == 0 or len(candidates) < 2:
            return min(candidates, key=lambda s: s.routing_key, default=None)
        # One price per prompt token for every candidate (they run the same model; their estimates differ by noise,
        # and a worker's first steps overprice it): a cold prompt then costs the same everywhere and the load decides.
        if _imbalanced(candidates):
            return min(candidates, key=lambda s: s.routing_key)
        price = max((s.seconds_per_token for s in candidates), default=0.0) or _DEFAULT_TOKEN_S
        return min(candidates, key=lambda s: self.prefix_cost(s, prompt, price))

    def prefix_cost(self, state: SchedulerState, prompt: PromptPages, seconds_per_token: float) -> tuple[float, ...]:
        """Prefix-aware routing's key (Dynamo's overlap-versus-load cost, in seconds): the wait its load
        projects (`routing_key`), plus `prefix_weight` times the prefill of the prompt tokens not cached there. A
        worker holding a prompt's pages wins while its queue costs less than computing them elsewhere; past that
        the load term sends the prompt on, so one hot prefix never piles every request on one worker."""
        wait_s, *tie_breaks = state.routing_key
        uncached = len(prompt.token_ids) - prompt.cached_tokens(self.prefix_index, state.address.worker_id, state.ready)
        return wait_s + self.prefix_weight * uncached * seconds_per_token, *tie_breaks

    def apply(self, message: WorkerSet) -> tuple[list[SchedulerState], list[SchedulerState], list[SchedulerState]]:
        """Takes the daemon's set; returns the workers it added, those it newly calls draining, and those it
        dropped (no longer in this view)."""
        self.worker_set.update(message)
        known = {s.address.worker_id: s for s in self.schedulers}
        added, draining = [], []
        for info in message.workers:
            state = known.get(info.worker_id)
            if state is None:
                address = SchedulerAddress(info.worker_id, info.model_name, info.group, info.input_address)
                state = SchedulerState(address, info.state, info.epoch)
                self.schedulers.append(state)
                added.append(state)
            elif info.state == WorkerState.DRAINING and state.worker_state != WorkerState.DRAINING:
                draining.append(state)
            _take_info(state, info)
        listed = {info.worker_id for info in message.workers}
        dropped = [s for s in self.schedulers if s.address.worker_id not in listed]
        self.schedulers = [s for s in self.schedulers if s.address.worker_id in listed]
        return added, draining, dropped


def _take_info(state: SchedulerState, info: WorkerInfo) -> None:
    state.worker_state, state.epoch = WorkerState(info.state), info.epoch
    state.warmup_seconds, state.standby, state.role = info.warmup_seconds, info.standby, Role(info.role)


def _imbalanced(candidates: list[SchedulerState]) -> bool:
    """Whether the workers' requests in flight are too uneven for the prefix term (see _BALANCE_RELATIVE)."""
    loads = [s.outstanding for s in candidates]
    batch = max((s.ready.max_num_seqs for s in candidates if s.ready is not None), default=4)
    return max(loads) > _BALANCE_RELATIVE * min(loads) and max(loads) - min(loads) > max(1, batch // 2)
