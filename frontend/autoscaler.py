"""The autoscaler's loop in the frontend: once a tick, each model's load (the workers' reports, this frontend's
queue) goes through common.autoscale_policy, and a changed decision goes to the daemon, which starts, promotes or
drains workers. The decision is also `tokend:desired_replicas`, for an HPA or KEDA across machines.

The frontend runs it because it holds the leading indicators: the queue a request waits in before any worker sees
it, and every worker's projected time to first token.
"""

from __future__ import annotations

import asyncio
import time

from common.autoscale_policy import AutoscalePolicy, AutoscaleState, WorkerSnapshot
from common.lanes import Role, WorkerState
from frontend.admission import AdmissionController
from frontend.arrival_window import ArrivalWindow
from frontend.autoscale_decision import PoolView, Sizing, Verdict, decide_pool
from frontend.autoscale_inputs import AutoscaleInputs
from frontend.control_link import ControlLink
from frontend.metrics import FrontendMetrics
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import FrontendSpec

TICK_S = 1.0
EXPORT_MAX_WORKERS = 1000  # the ceiling of an exported decision: the pods' own autoscaler has the real one


class Autoscaler:
    """With autoscale_max_workers set, it scales the box's workers (the daemon acts on its decisions); without, it
    only exports them (`tokend:desired_replicas`) for an HPA or KEDA scaling pods across machines: then the floor
    is 0, so that a pod whose load has been quiet for the delay says its share fits on the others (the pods'
    values add up to the pods needed: docs/deploy/kubernetes.md, "Autoscaling pods")."""

    def __init__(self, spec: FrontendSpec, link: SchedulerLink, admission: AdmissionController,
                 control: ControlLink, metrics: FrontendMetrics, log):  # fmt: skip
        settings = spec.autoscale
        self._acts = settings.enabled
        self._policy = AutoscalePolicy(
            max_workers=settings.autoscale_max_workers if self._acts else EXPORT_MAX_WORKERS,
            min_workers=settings.autoscale_min_workers if self._acts else 0,
            min_standby=settings.min_standby,
            ttft_fraction=settings.autoscale_ttft_fraction,
            quiet_fraction=settings.autoscale_ttft_fraction / 2,  # quiet well under the bound, whatever it is
            scale_down_delay_s=settings.autoscale_scale_down_delay,
            peak_rps=settings.autoscale_peak_rps,
            peak_memory_s=settings.autoscale_peak_memory,
            headroom=settings.autoscale_headroom,
        )
        self._ttft_target_s = spec.admission.interactive_ttft_target
        self._min_prefill_prompt = spec.disagg_min_prompt_tokens
        self._link = link
        self._admission = admission
        self._control = control
        self._metrics = metrics
        self._log = log
        # Keyed by (model, the pool's role): Role.MIXED or Role.DECODE for the routed pool, Role.PREFILL.
        self._states: dict[tuple[str, Role], AutoscaleState] = {}  # what each pool's loop remembers
        self._sent: dict[tuple[str, Role], tuple[int, int]] = {}  # the counts last asked
        self._warmups_seen: set[str] = set()  # workers whose warm-up time is in the histogram
        self._came_up: set[str] = set()  # models that have had a serving worker since the frontend started
        self.latest: dict[tuple[str, Role], Verdict] = {}  # each pool's latest decision (GetLoad)
        policy = self._policy
        self.inputs = AutoscaleInputs(policy.forecast_history_s, policy.forecast_window_s, policy.peak_memory_s,
                                      spec.disagg_min_prompt_tokens)  # fmt: skip

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            for model in dict.fromkeys(s.address.model_name for s in self._link.schedulers):
                try:
                    await self._tick(model)
                except Exception as error:  # one bad tick must not stop scaling for good
                    self._log.error("autoscaler_failed", model=model, error=repr(error), exc_info=True)

    async def _tick(self, model: str) -> None:
        workers = [s for s in self._link.schedulers if s.address.model_name == model]
        for state in workers:
            if state.warmup_seconds and state.address.worker_id not in self._warmups_seen:
                self._warmups_seen.add(state.address.worker_id)
                self._metrics.worker_warmup_seconds.labels(model).observe(state.warmup_seconds)
        if self._link.expects_capacity(model):
            return  # a rollout is replacing the workers: it decides alone until it is done
        if model not in self._came_up:
            if not self._link.ready_schedulers(model):
                # Starting: its configured workers are still loading. A standby that warms first is not promoted
                # in their place (which would only swap roles and cold-start another standby); once the model has
                # served, no serving worker means a crash, and a warm standby is promoted at once.
                return
            self._came_up.add(model)
        now = time.monotonic()
        has_prefill = any(s.role == Role.PREFILL for s in workers)
        arrivals = self.inputs.window(model)  # kept as they come: a tick reads its counts, never every arrival
        await self._tick_pool(model, Role.DECODE if has_prefill else Role.MIXED, workers, arrivals, now)
        if has_prefill:  # disaggregated serving: the prefill workers are a pool of their own
            await self._tick_pool(model, Role.PREFILL, workers, arrivals, now)

    async def _tick_pool(
        self, model: str, role: Role, workers: list[SchedulerState], arrivals: ArrivalWindow, now: float
    ) -> None:
        """One pool's decision (frontend.autoscale_decision): the routed workers (mixed, or decode beside a prefill
        pool) on the frontend's queue, the forecast and the peak; the prefill workers on their own projected TTFT
        (requests reach them with no queue of their own), and on the forecast and the peak of the long prompts."""
        if any(s.load is None for s in self._link.ready_schedulers(model, role == Role.PREFILL)):
            return  # a ready worker yet to report its load would count as missing, and ask for one more in its place
        state = self._states.setdefault((model, role), AutoscaleState())
        verdict = decide_pool(self._view(model, role, workers, arrivals, now), role == Role.PREFILL,
                              self._min_prefill_prompt, self._ttft_target_s, self._policy, state)  # fmt: skip
        decision, snapshot, standby = verdict.decision, verdict.snapshot, verdict.standby
        self.latest[(model, role)] = verdict
        self._metrics.desired_replicas.labels(model, role).set(decision.desired)
        self._metrics.desired_standby.labels(model, role).set(standby)
        if (decision.desired, standby) == self._sent.get((model, role)):
            return
        if decision.direction != "hold":
            self._metrics.autoscaler_decisions.labels(decision.direction, decision.reason).inc()
        self._log.info("autoscale", model=model, role=role, desired=decision.desired, standby=standby,
                       peak_rps=round(verdict.peak_rps, 3), direction=decision.direction, reason=decision.reason,
                       queue_depth=snapshot.queue_depth, queue_wait_s=round(snapshot.queue_wait_s, 3),
                       effective_ttft_s=round(snapshot.effective_ttft_s, 3))  # fmt: skip
        self._sent[(model, role)] = (decision.desired, standby)
        if self._acts:
            await self._control.scale(model, decision.desired, standby, decision.reason, role.pool)

    def _view(self, model: str, role: Role, workers: list[SchedulerState], arrivals: ArrivalWindow,
              now: float) -> PoolView:  # fmt: skip
        prefill = role == Role.PREFILL
        members = [s for s in workers if (s.role == Role.PREFILL) == prefill]
        depth, oldest_wait_s = (0, 0.0) if prefill else self._admission.queue_of(model)
        return PoolView(
            now=now,
            workers=[
                WorkerSnapshot(
                    s.load.projected_ttft_seconds, s.load.num_running, s.load.num_waiting, s.ready.max_num_seqs
                )  # fmt: skip
                for s in self._link.ready_schedulers(model, prefill)
                if s.load is not None
            ],
            queue_depth=depth,
            queue_wait_s=oldest_wait_s,
            num_standby=sum(s.worker_state == WorkerState.STANDBY for s in members),
            num_starting=sum(s.worker_state == WorkerState.STARTING and not s.standby for s in members),
            arrivals=arrivals,
            window_counts=self.inputs.window_counts(model),
            sizing=self._sizing(model),
            warmup_s=max((s.warmup_seconds for s in workers), default=0.0),
        )

    def _sizing(self, model: str) -> Sizing | None:
        """The fitted step cost and a ready worker's limits; None until a cost is fitted and a worker is ready."""
        step_cost = self.inputs.step_model(model)
        ready = [s.ready for s in self._link.ready_schedulers(model)]
        if step_cost is None or not ready:
            return None
        return Sizing(step_cost, ready[0].max_num_seqs, ready[0].max_num_batched_tokens or ready[0].max_num_seqs)
