"""Priority admission: which request goes to a scheduler next, and which are shed when there is not enough.

Requests wait here, not in the schedulers, so that policy decides the order: interactive before batch; within
a class, the backlogged tenant that has been served the fewest tokens first (virtual token counters); batch
shed before interactive. Batch work gets only the slots interactive work has left spare over the last few
seconds; interactive work gets every slot, and a little beyond (it then takes a running batch request's slot
there). Per-tenant limits (requests in flight, tokens per minute) are refused at once with RESOURCE_EXHAUSTED
and a retry hint. Waiting requests of a model that has no live scheduler left fail at once with UNAVAILABLE:
nothing can take them until one comes back, and another instance may serve them now.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import time
from dataclasses import dataclass, field

import grpc

from frontend.errors import RequestError
from frontend.metrics import FrontendMetrics
from frontend.prefix_index import PromptPages
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import AdmissionSpec, TenantSpec
from gpu_runtime.ipc.enums import Priority

_RATE_WINDOW_S = 10.0  # dispatches counted over this window give the pool's service rate
# Batch work may use the slots interactive work left unused at its peak over this window. A batch request sent
# into slots interactive needs again soon is preempted, its work thrown away, and it still takes capacity while
# it runs (measured: letting batch fill the free slots 2 s after interactive last waited lost 30-40 batch
# requests' work per 30 s at 2x load and pushed interactive into being shed).
SPARE_WINDOW_S = 5.0
# Interactive requests are refused once their projected TTFT passes this share of the target: the projection
# leaves out the prefill and its noise, and the p99, not the mean, must stay within the target.
_INTERACTIVE_MARGIN = 0.85


class Shed(RequestError):
    """RESOURCE_EXHAUSTED: refused or dropped under pressure; `retry_after_s` says when to try again."""

    def __init__(self, message: str, reason: str, retry_after_s: float):
        # Said twice: in words, and as gRPC's own server pushback, which clients with a retry policy obey (and
        # the gateway turns into Retry-After).
        pushback = (("grpc-retry-pushback-ms", str(math.ceil(retry_after_s * 1000))),)
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"{message}; retry in {math.ceil(retry_after_s)} s", pushback
        )
        self.reason = reason
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Ticket:
    model: str
    tenant: str
    priority: Priority
    cost: int  # tokens it may use (prompt + max_tokens): what fairness charges at dispatch
    arrived: float = field(default_factory=time.monotonic)
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    route_draw: float = field(default_factory=random.random)  # which side of a canary's split it falls on
    prompt: PromptPages | None = None  # for prefix-aware routing: where its pages are


@dataclass(eq=False)
class Pool:
    """The waiting requests of one model, and what fairness and projections need to know about it."""

    # class -> tenant -> waiting tickets, oldest first
    queues: dict[Priority, dict[str, collections.deque[Ticket]]] = field(
        default_factory=lambda: {p: {} for p in Priority}
    )
    served: dict[tuple[Priority, str], float] = field(default_factory=dict)  # virtual tokens served
    dispatches: collections.deque[float] = field(default_factory=collections.deque)  # recent dispatch times
    in_flight: collections.Counter[Priority] = field(default_factory=collections.Counter)  # dispatched, not ended
    # (time, interactive requests in flight or queued), kept so that its maximum over SPARE_WINDOW_S is the
    # front entry: interactive's recent peak demand for slots
    interactive_peaks: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)

    def note_interactive_demand(self, now: float) -> None:
        demand = self.in_flight[Priority.INTERACTIVE] + sum(len(q) for q in self.queues[Priority.INTERACTIVE].values())
        while self.interactive_peaks and self.interactive_peaks[-1][1] <= demand:
            self.interactive_peaks.pop()  # a smaller, older sample can never be the window's maximum again
        self.interactive_peaks.append((now, demand))
        while self.interactive_peaks[0][0] < now - SPARE_WINDOW_S:
            self.interactive_peaks.popleft()

    @property
    def interactive_peak(self) -> int:
        return self.interactive_peaks[0][1] if self.interactive_peaks else 0


class TokenBucket:
    """tokens_per_minute on actual tokens: usage is charged after the fact, and the bucket may go negative."""

    def __init__(self, tokens_per_minute: int):
        self.rate = tokens_per_minute / 60.0
        self.capacity = float(tokens_per_minute)
        self.level = self.capacity
        self.updated = time.monotonic()

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        return self.level

    def charge(self, tokens: int) -> None:
        self.refill()
        self.level -= tokens

    def resized(self, tokens_per_minute: int) -> TokenBucket:
        """This bucket under a new limit (a reload): what was spent of the old one stays spent."""
        if tokens_per_minute == self.capacity:
            return self
        bucket = TokenBucket(tokens_per_minute)
        bucket.level = bucket.capacity - (self.capacity - self.refill())
        return bucket


class AdmissionController:
    def __init__(self, link: SchedulerLink, spec: AdmissionSpec, metrics: FrontendMetrics, tenants: list[TenantSpec]):
        self._link = link
        self._spec = spec
        self._metrics = metrics
        self._tenants = {t.name: t for t in tenants}
        self._buckets = {t.name: TokenBucket(t.tokens_per_minute) for t in tenants if t.tokens_per_minute}
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._pools: dict[str, Pool] = {}
        self._expiry = asyncio.get_running_loop().create_task(self._shed_expired_forever())

    def close(self) -> None:
        self._expiry.cancel()

    def replace_tenants(self, tenants: list[TenantSpec]) -> None:
        """A reload's tenants and limits, for requests from now on. A quota left as it was keeps its bucket (a
        reload must not refill it); requests in flight, a removed tenant's too, run on and are released as ever."""
        old = self._buckets
        self._tenants = {t.name: t for t in tenants}
        self._buckets = {
            t.name: old[t.name].resized(t.tokens_per_minute) if t.name in old else TokenBucket(t.tokens_per_minute)
            for t in tenants
            if t.tokens_per_minute
        }

    # -- the way in ---------------------------------------------------------------------------------------------

    async def admit(self, model: str, tenant: TenantSpec | None, priority: Priority, cost: int,
                    prompt: PromptPages | None = None) -> SchedulerState:  # fmt: skip
        """Waits for the request's turn; returns the scheduler to send it to (the one its `prompt` costs least on),
        or raises Shed."""
        name = tenant.name if tenant else ""
        self._check_tenant_limits(tenant, priority)
        ticket = Ticket(model, name, priority, cost, prompt=prompt)
        self._in_flight[name] += 1
        try:
            self._enqueue(ticket)
            return await ticket.future
        except BaseException:
            self._remove(ticket)
            self._in_flight[name] -= 1
            if ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                ticket.future.result().unreserve()  # dispatched, but its caller went away before sending it
                self._pool(model).in_flight[priority] -= 1
            raise

    def release(self, model: str, tenant: str | None, priority: Priority) -> None:
        """A dispatched request ended: its tenant has one fewer in flight, and a slot may be free."""
        self._in_flight[tenant or ""] -= 1
        self._pool(model).in_flight[priority] -= 1
        self.pump()

    def account(
        self, model: str, tenant: str, priority: Priority, estimated: int, prompt: int, completion: int
    ) -> None:
        """Corrects fairness counters with what a request really used, and charges its tenant's bucket."""
        served = self._pool(model).served
        if (priority, tenant) in served:
            served[(priority, tenant)] += prompt + completion - estimated
        bucket = self._buckets.get(tenant)
        if bucket is not None:
            bucket.charge(prompt + completion)

    # -- queueing and shedding ----------------------------------------------------------------------------------

    def _check_tenant_limits(self, tenant: TenantSpec | None, priority: Priority) -> None:
        if tenant is None:
            return
        if tenant.max_concurrent and self._in_flight[tenant.name] >= tenant.max_concurrent:
            self._count_shed(priority, "max_concurrent")
            raise Shed(f"tenant {tenant.name!r} has {tenant.max_concurrent} requests in flight (max_concurrent)",
                       "max_concurrent", 1.0)  # fmt: skip
        bucket = self._buckets.get(tenant.name)
        if bucket is not None and bucket.refill() <= 0:
            self._count_shed(priority, "tokens_per_minute")
            raise Shed(f"tenant {tenant.name!r} used its tokens_per_minute", "tokens_per_minute",
                       -bucket.level / bucket.rate + 1.0)  # fmt: skip

    def _enqueue(self, ticket: Ticket) -> None:
        pool = self._pool(ticket.model)
        tenants = pool.queues[ticket.priority]
        if ticket.tenant not in tenants or not tenants[ticket.tenant]:
            # A tenant that becomes backlogged starts level with the others: idle time earns no credit.
            backlogged = [pool.served.get((ticket.priority, t), 0.0) for t, q in tenants.items() if q]
            key = (ticket.priority, ticket.tenant)
            pool.served[key] = max(pool.served.get(key, 0.0), min(backlogged, default=0.0))
        tenants.setdefault(ticket.tenant, collections.deque()).append(ticket)
        self.pump()
        if not ticket.future.done():  # it has to wait: the policy decides whether it may
            self._metrics.admission_queued.labels(ticket.priority.label).inc()
            self._apply_pressure(ticket)
        self._update_depth()

    def _apply_pressure(self, ticket: Ticket) -> None:
        """Sheds by policy once a request must wait: batch before interactive, the newest batch first."""
        projected = self._projected_ttft(ticket)
        if ticket.priority == Priority.BATCH:
            if projected > self._spec.batch_ttft_target and projected > self._spec.batch_max_queue_wait:
                self._remove(ticket)
                self._shed_ticket(ticket, "projected_ttft", projected)
                return
        elif projected > _INTERACTIVE_MARGIN * self._spec.interactive_ttft_target:
            # Interactive is about to miss its target: queued batch work gives way, as policy says.
            while (victim := self._newest(ticket.model, Priority.BATCH)) is not None:
                self._remove(victim)
                self._shed_ticket(victim, "interactive_pressure", self._spec.batch_max_queue_wait)
            running_batch = sum(s.load.num_running_batch for s in self._link.ready_schedulers(ticket.model) if s.load)
            if running_batch == 0:
                # No batch work left to make room: interactive alone exceeds capacity, and refusing a few keeps
                # the target for the rest instead of letting every one of them miss it.
                self._remove(ticket)
                self._shed_ticket(ticket, "projected_ttft", max(1.0, projected))
                return
        if self._num_queued(ticket.model) > self._spec.max_queued_requests:
            victim = self._newest(ticket.model, Priority.BATCH)  # a batch arrival is the newest itself
            if victim is None:
                victim = ticket  # no batch work can make room: the interactive arrival is refused
            self._remove(victim)
            self._shed_ticket(victim, "queue_full", self._retry_after(victim))

    def _retry_after(self, ticket: Ticket) -> float:
        """When a request shed for a full queue may try again: batch work after its longest allowed wait;
        interactive work once the queue ahead of it is projected to drain (its TTFT target while no drain rate
        is known yet), at least 1 s and never later than batch work is told."""
        if ticket.priority == Priority.BATCH:
            return self._spec.batch_max_queue_wait
        if _dispatch_rate(self._pool(ticket.model)) > 0:
            hint = self._projected_ttft(ticket)
        else:  # nothing dispatched lately: no rate to project the drain from
            hint = self._spec.interactive_ttft_target
        return max(1.0, min(hint, self._spec.batch_max_queue_wait))

    def pump(self) -> None:
        """Dispatches queued tickets, most urgent class first, while schedulers have room for them."""
        now = time.monotonic()
        for model, pool in self._pools.items():
            if not self._link.ready_schedulers(model) and not self._link.expects_capacity(model):
                self._fail_queued(model, pool)
            pool.note_interactive_demand(now)  # at every change of demand: arrivals, dispatches, ends all pump
            self._metrics.admission_batch_slots.labels(model).set(self._spare_slots(model, pool))
            for priority in Priority:
                while (ticket := self._next_ticket(pool, priority)) is not None:
                    if priority == Priority.BATCH and pool.in_flight[priority] >= self._spare_slots(model, pool):
                        break
                    scheduler = self._scheduler_with_room(ticket)
                    if scheduler is None:
                        break
                    pool.queues[priority][ticket.tenant].popleft()
                    key = (priority, ticket.tenant)
                    pool.served[key] = pool.served.get(key, 0.0) + ticket.cost
                    pool.dispatches.append(time.monotonic())
                    pool.in_flight[priority] += 1
                    self._metrics.admission_admitted.labels(priority.label).inc()
                    scheduler.reserve()  # the caller's until it sends the request there (or holds it for a handover)
                    ticket.future.set_result(scheduler)
        self._update_depth()

    def _fail_queued(self, model: str, pool: Pool) -> None:
        """The model lost its last live scheduler: its waiting requests fail now instead of hanging."""
        for tenants in pool.queues.values():
            for queue in tenants.values():
                while queue:
                    ticket = queue.popleft()
                    if not ticket.future.done():
                        ticket.future.set_exception(
                            RequestError(grpc.StatusCode.UNAVAILABLE, f"model {model!r} has no live scheduler; retry")
                        )

    @staticmethod
    def _next_ticket(pool: Pool, priority: Priority) -> Ticket | None:
        """The oldest ticket of the backlogged tenant served least so far in this class."""
        backlogged = [(pool.served.get((priority, t), 0.0), t) for t, q in pool.queues[priority].items() if q]
        if not backlogged:
            return None
        _, tenant = min(backlogged)
        return pool.queues[priority][tenant][0]

    def _pool(self, model: str) -> Pool:
        return self._pools.setdefault(model, Pool())

    def _spare_slots(self, model: str, pool: Pool) -> int:
        """Slots in the pool that interactive work did not need at its peak over the last few seconds."""
        slots = sum(s.ready.max_num_seqs for s in self._link.ready_schedulers(model))
        return slots - pool.interactive_peak

    def _scheduler_with_room(self, ticket: Ticket) -> SchedulerState | None:
        limit = self._slot_limit(ticket.priority)
        has_room = lambda s: s.outstanding < limit(s)  # noqa: E731
        return self._link.workers.pick(ticket.model, draw=ticket.route_draw, has_room=has_room, prompt=ticket.prompt)

    def _slot_limit(self, priority: Priority):
        if priority == Priority.INTERACTIVE:
            # Beyond the batch's depth only as far as batch requests hold slots there: the scheduler lets an
            # interactive request take one of theirs. Past that it would just wait in the scheduler's queue,
            # where this policy could no longer see or order it.
            def interactive_limit(s: SchedulerState) -> int:
                displaceable = s.load.num_running_batch if s.load is not None else 0
                return s.ready.max_num_seqs + min(displaceable, max(1, s.ready.max_num_seqs // 2))

            return interactive_limit
        return lambda s: s.ready.max_num_seqs

    def _projected_ttft(self, ticket: Ticket) -> float:
        """The pool's projected first-token time, plus the wait for the tickets queued ahead of this one."""
        ready = self._link.ready_schedulers(ticket.model)
        base = min((s.projected_ttft_seconds for s in ready), default=0.0)
        pool = self._pool(ticket.model)
        ahead = sum(len(q) for p in Priority if p <= ticket.priority for q in pool.queues[p].values())
        rate = _dispatch_rate(pool)
        return base + (ahead / rate if rate > 0 and ahead else 0.0)

    def _target(self, priority: Priority) -> float:
        if priority == Priority.INTERACTIVE:
            return self._spec.interactive_ttft_target
        return self._spec.batch_ttft_target

    async def _shed_expired_forever(self) -> None:
        """Sheds batch work that waited too long, and lets held batch work go once interactive pressure ends."""
        while True:
            await asyncio.sleep(0.25)
            self.pump()
            now = time.monotonic()
            for pool in self._pools.values():
                for queue in pool.queues[Priority.BATCH].values():
                    while queue and now - queue[0].arrived > self._spec.batch_max_queue_wait:
                        self._shed_ticket(queue.popleft(), "max_wait", self._spec.batch_max_queue_wait)
            self._update_depth()

    def _shed_ticket(self, ticket: Ticket, reason: str, retry_after_s: float) -> None:
        self._count_shed(ticket.priority, reason)
        if not ticket.future.done():
            what = ticket.priority.label
            ticket.future.set_exception(
                Shed(f"server overloaded: {what} request shed ({reason})", reason, retry_after_s)
            )

    def _count_shed(self, priority: Priority, reason: str) -> None:
        self._metrics.admission_shed.labels(priority.label, reason).inc()

    def _newest(self, model: str, priority: Priority) -> Ticket | None:
        tickets = [q[-1] for q in self._pool(model).queues[priority].values() if q]
        return max(tickets, key=lambda t: t.arrived, default=None)

    def _remove(self, ticket: Ticket) -> None:
        queue = self._pool(ticket.model).queues[ticket.priority].get(ticket.tenant)
        if queue and ticket in queue:
            queue.remove(ticket)
        self._update_depth()

    def queue_of(self, model: str) -> tuple[int, float]:
        """The model's requests waiting here for a slot, and how long the oldest of them has waited (seconds)."""
        tickets = [t for tenants in self._pool(model).queues.values() for q in tenants.values() for t in q]
        oldest = min((t.arrived for t in tickets), default=None)
        return len(tickets), 0.0 if oldest is None else time.monotonic() - oldest

    def _num_queued(self, model: str) -> int:
        return sum(len(q) for tenants in self._pool(model).queues.values() for q in tenants.values())

    def _update_depth(self) -> None:
        for priority in Priority:
            depth = sum(len(q) for pool in self._pools.values() for q in pool.queues[priority].values())
            self._metrics.admission_queue_depth.labels(priority.label).set(depth)


def _dispatch_rate(pool: Pool) -> float:
    """Dispatches per second over the last few seconds: how fast the pool's queue moves."""
    now = time.monotonic()
    while pool.dispatches and pool.dispatches[0] < now - _RATE_WINDOW_S:
        pool.dispatches.popleft()
    span = now - pool.dispatches[0] if len(pool.dispatches) > 1 else 0.0
    return (len(pool.dispatches) - 1) / span if span > 0 else 0.0
