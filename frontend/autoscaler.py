"""The autoscaler's loop in the frontend: once a tick, each model's load (the workers' reports, this frontend's
queue) goes through common.autoscale_policy, and a changed decision goes to the daemon, which starts, promotes or
drains workers. The decision is also `tokend:desired_replicas`, for an HPA or KEDA across machines.

The frontend runs it because it holds the leading indicators: the queue a request waits in before any worker sees
it, and every worker's projected time to first token.
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

from common.autoscale_policy import (
    AutoscalePolicy,
    AutoscaleState,
    Decision,
    LoadSnapshot,
    StepTimeModel,
    WorkerSnapshot,
    decide,
    forecast_floor,
    peak_rate,
    standby_target,
    worker_capacity,
)
from frontend.admission import AdmissionController
from frontend.autoscale_inputs import AutoscaleInputs
from frontend.control_link import ControlLink
from frontend.control_messages import WorkerState
from frontend.metrics import FrontendMetrics
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import FrontendSpec
from gpu_runtime.ipc.messages import SchedulerReady

TICK_S = 1.0
_DEFAULT_WARMUP_S = 30.0  # the forecast's horizon until a worker's warm-up has been measured


class Verdict(NamedTuple):
    """A model's latest decision and what it saw (Admin.GetLoad)."""

    decision: Decision
    snapshot: LoadSnapshot
    standby: int  # warm standbys wanted beside the serving workers
    peak_rps: float  # the peak they are held for


class Autoscaler:
    def __init__(self, spec: FrontendSpec, link: SchedulerLink, admission: AdmissionController,
                 control: ControlLink, metrics: FrontendMetrics, log):  # fmt: skip
        settings = spec.autoscale
        self._policy = AutoscalePolicy(
            max_workers=settings.autoscale_max_workers,
            min_workers=settings.autoscale_min_workers,
            min_standby=settings.min_standby,
            ttft_fraction=settings.autoscale_ttft_fraction,
            quiet_fraction=settings.autoscale_ttft_fraction / 2,  # quiet well under the bound, whatever it is
            scale_down_delay_s=settings.autoscale_scale_down_delay,
            peak_rps=settings.autoscale_peak_rps,
            peak_memory_s=settings.autoscale_peak_memory,
        )
        self._ttft_target_s = spec.admission.interactive_ttft_target
        self._min_prefill_prompt = spec.disagg_min_prompt_tokens
        self._link = link
        self._admission = admission
        self._control = control
        self._metrics = metrics
        self._log = log
        self._states: dict[tuple[str, str], AutoscaleState] = {}  # (model, pool role) -> what its loop remembers
        self._sent: dict[tuple[str, str], tuple[int, int]] = {}  # (model, pool role) -> the counts last asked
        self._warmups_seen: set[str] = set()  # workers whose warm-up time is in the histogram
        self._came_up: set[str] = set()  # models that have had a serving worker since the frontend started
        self.latest: dict[tuple[str, str], Verdict] = {}  # (model, pool role) -> its latest decision (GetLoad)
        policy = self._policy
        self.inputs = AutoscaleInputs(policy.forecast_history_s, policy.forecast_window_s, policy.peak_memory_s)

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
        has_prefill = any(s.last_role == "prefill" for s in workers)
        arrivals = self.inputs.arrivals(model)  # sorted once a tick, for both pools' forecasts and capacities
        await self._tick_pool(model, "decode" if has_prefill else "mixed", workers, arrivals, now)
        if has_prefill:  # disaggregated serving: the prefill workers are a pool of their own
            await self._tick_pool(model, "prefill", workers, arrivals, now)

    async def _tick_pool(
        self, model: str, role: str, workers: list[SchedulerState], arrivals: list[tuple[float, int, int]], now: float
    ) -> None:
        """One pool's decision: the routed workers ("mixed", or "decode" beside a prefill pool) on the frontend's
        queue, the forecast and the peak; the prefill workers on their own projected TTFT (requests reach them
        with no queue of their own), and on the forecast and the peak of the long prompts, which are theirs."""
        prefill = role == "prefill"
        members = [s for s in workers if (s.last_role == "prefill") == prefill]
        depth, oldest_wait_s = (0, 0.0) if prefill else self._admission.queue_of(model)
        snapshot = LoadSnapshot(
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
            ttft_target_s=self._ttft_target_s,
            num_standby=sum(s.worker_state == WorkerState.STANDBY for s in members),
            num_starting=sum(s.worker_state == WorkerState.STARTING and not s.standby for s in members),
        )
        state = self._states.setdefault((model, role), AutoscaleState())
        arrivals, share = self._pool_arrivals(arrivals, prefill)
        decision = decide(snapshot, self._policy, state, self._forecast_floor(model, now, arrivals))
        peak = peak_rate(self.inputs.window_counts(model), now, self._policy) * share
        capacity = self._capacity_rps(model, arrivals)
        standby = standby_target(peak, capacity, decision.desired, now, self._policy, state)
        self.latest[(model, role)] = Verdict(decision, snapshot, standby, peak)
        self._metrics.desired_replicas.labels(model, role).set(decision.desired)
        self._metrics.desired_standby.labels(model, role).set(standby)
        if (decision.desired, standby) == self._sent.get((model, role)):
            return
        if decision.direction != "hold":
            self._metrics.autoscaler_decisions.labels(decision.direction, decision.reason).inc()
        self._log.info("autoscale", model=model, role=role, desired=decision.desired, standby=standby,
                       peak_rps=round(peak, 3), direction=decision.direction, reason=decision.reason,
                       queue_depth=depth, queue_wait_s=round(oldest_wait_s, 3),
                       effective_ttft_s=round(snapshot.effective_ttft_s, 3))  # fmt: skip
        self._sent[(model, role)] = (decision.desired, standby)
        await self._control.scale(model, decision.desired, standby, decision.reason, role)

    def _pool_arrivals(
        self, arrivals: list[tuple[float, int, int]], prefill: bool
    ) -> tuple[list[tuple[float, int, int]], float]:
        """Of the model's recent arrivals (sorted), those a pool serves, and their share of all arrivals (the share
        of the peak that is the pool's). A prefill worker computes the prompts of disagg_min_prompt_tokens or more
        and one token of each; the routed pool sees every request."""
        if not prefill:
            return arrivals, 1.0
        long = [(arrived, prompt, 1) for arrived, prompt, _ in arrivals if prompt >= self._min_prefill_prompt]
        # Before any arrival, every request is taken as a long one: a declared peak then holds prefill workers too.
        return long, len(long) / len(arrivals) if arrivals else 1.0

    def _capacity_rps(self, model: str, arrivals: list[tuple[float, int, int]]) -> float:
        """One worker's requests/s within the TTFT target for the recent request sizes, by the fitted step-time
        model; 0 until there is one (standby_target then holds min_standby, or all it may for a declared peak)."""
        sizing = self._sizing(model)
        if sizing is None or not arrivals:
            return 0.0
        step_model, ready, budget = sizing
        prompt = sum(a[1] for a in arrivals) / len(arrivals)
        output = sum(a[2] for a in arrivals) / len(arrivals)
        return worker_capacity(step_model, prompt, output, self._policy.ttft_fraction * self._ttft_target_s,
                               ready.max_num_seqs, budget).requests_per_s  # fmt: skip

    def _forecast_floor(self, model: str, now: float, arrivals: list[tuple[float, int, int]]) -> int:
        """The slow loop: the workers the forecast arrivals need by the time a worker started now would serve (the
        model's measured warm-up), by the fitted step-time model; 0 until there is a model to fit."""
        sizing = self._sizing(model)
        if sizing is None:
            return 0
        step_model, ready, budget = sizing
        warmups = [s.warmup_seconds for s in self._link.schedulers if s.address.model_name == model]
        horizon_s = max(warmups, default=0.0) or _DEFAULT_WARMUP_S
        return forecast_floor(arrivals, now, horizon_s, step_model, self._policy, ttft_target_s=self._ttft_target_s,
                              max_num_seqs=ready.max_num_seqs, max_num_batched_tokens=budget)  # fmt: skip

    def _sizing(self, model: str) -> tuple[StepTimeModel, SchedulerReady, int] | None:
        """What sizing a worker's capacity needs: the fitted step-time model, a ready worker's limits and its token
        budget per step; None until a model is fitted and a worker is ready."""
        step_model = self.inputs.step_model(model)
        ready = [s.ready for s in self._link.ready_schedulers(model)]
        if step_model is None or not ready:
            return None
        return step_model, ready[0], ready[0].max_num_batched_tokens or ready[0].max_num_seqs
