"""Continuous batching: each step runs the decodes, then prefill chunks, then admits waiting requests."""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from gpu_runtime.engine_config import SchedulerConfig
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.latency import LatencyPolicy, StepPlan, prefill_seconds
from gpu_runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class PrefillWork:
    seq: Sequence
    num_new_tokens: int  # may be a chunk: the rest of the prompt follows in later steps


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: one token per decode, a run of prompt tokens per prefill, one padding row per
    finished sequence that a static batch still holds."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)
    padding: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    plan: StepPlan | None = None

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        """Rows the forward computes, padding included (it costs the same as a decode)."""
        return len(self.decodes) + sum(work.num_new_tokens for work in self.prefills) + len(self.padding)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills) + len(self.padding)

    def tokens_of(self, seq: Sequence) -> int:
        if seq in self.decodes:
            return 1
        return next((work.num_new_tokens for work in self.prefills if work.seq is seq), 0)

    def drop(self, seq: Sequence) -> None:
        if seq in self.decodes:
            self.decodes.remove(seq)
        self.prefills = [work for work in self.prefills if work.seq is not seq]


class Scheduler:
    """Owns the waiting queue (ordered by priority, then arrival) and the running batch (in admission order).

    When pages run out, the victim is the lowest-priority sequence, most recently admitted among those; it
    is preempted by recompute: its pages are freed (their full pages stay in the prefix cache, so its own
    prefix is usually found again) and it goes back to the waiting queue in its original place.

    Static scheduling (the benchmark baseline) batches the way FasterTransformer or `transformers` generate do:
    a batch is admitted whole, and a sequence that finishes early keeps its slot and pages and is still
    computed, as a padding row whose output nobody reads, until the whole batch has finished.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.held: list[Sequence] = []  # static batching only: finished, still holding slot and pages
        self.num_preemptions = 0
        self.policy = LatencyPolicy(config, min_chunk=kv.page_size)
        self._admissions = itertools.count()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queues a new (or preempted) sequence in its place: by priority, then arrival."""
        self.kv.hash_new_pages(seq)
        bisect.insort(self.waiting, seq, key=lambda s: s.queue_key)

    # -- one step ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        head_tokens = self.waiting[0].num_uncomputed_tokens if self.waiting else 0
        out = SchedulerOutput(plan=self.policy.plan(len(self.running), head_tokens), padding=list(self.held))
        budget = self._schedule_running(out, out.plan.token_budget)
        if not out.preempted and self._may_admit():
            self._admit_waiting(out, budget, out.plan.max_running)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Decodes first, so a long prompt never stalls the streams; then the prompts still in prefill.
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.priority, s.admission_order))
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._tokens_to_schedule(seq.num_uncomputed_tokens, budget, out)
            if num_new == 0:
                continue
            while not self.kv.try_reserve(seq, seq.num_computed_tokens + num_new):
                victim = self._pick_victim(self.running)
                budget += out.tokens_of(victim)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                if num_new == 1 and seq.num_uncomputed_tokens == 1:
                    out.decodes.append(seq)
                else:
                    out.prefills.append(PrefillWork(seq, num_new))
                budget -= num_new
        return budget

    def _tokens_to_schedule(self, num_uncomputed: int, budget: int, out: SchedulerOutput) -> int:
        """How much of a sequence's remaining work fits this step's budget (0: none of it)."""
        if num_uncomputed <= budget:
            return num_uncomputed
        if self.config.enable_chunked_prefill:
            return max(budget, 0)
        # Unchunked, a prompt larger than the budget runs as the step's only prefill rather than waiting
        # forever (the decodes still run beside it).
        return num_uncomputed if not out.prefills else 0

    def _may_admit(self) -> bool:
        return self.config.scheduling == "continuous" or not self.running

    def _admit_waiting(self, out: SchedulerOutput, budget: int, max_running: int) -> None:
        static = self.config.scheduling == "static"
        depth = self.config.max_num_seqs if static else min(self.config.max_num_seqs, max_running)
        while self.waiting:
            seq = self.waiting[0]
            if len(self.running) >= depth:
                # Every slot is taken: a more urgent request takes a less urgent one's slot, else it waits.
                lower = [] if static else [s for s in self.running if s.priority > seq.priority]
                if not lower:
                    return
                victim = self._pick_victim(lower)
                budget += out.tokens_of(victim)
                self._preempt(victim, out)
            match = self.kv.find_cached_prefix(seq)
            remaining = seq.num_tokens - match.num_tokens(self.kv.page_size)
            # Static batching prefills its whole batch at once, whatever the budget.
            num_new = remaining if static else self._tokens_to_schedule(remaining, budget, out)
            if num_new == 0:
                return
            total = seq.num_tokens - remaining + num_new
            while not self.kv.try_admit(seq, match, total):
                lower = [s for s in self.running if s.priority > seq.priority]
                if not lower:
                    return  # waits for pages, in its place at the head of the queue
                victim = self._pick_victim(lower)  # a more urgent request displaces a less urgent one
                budget += out.tokens_of(victim)
                self._preempt(victim, out)
            self.waiting.pop(0)
            seq.num_computed_tokens = match.num_tokens(self.kv.page_size)
            if seq.num_preemptions == 0:  # a recompute after preemption is not a cache hit for the client
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            seq.admission_order = next(self._admissions)
            if seq.first_scheduled_time is None:  # its queue time ends here (a preempted one's requeue is not)
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.prefills.append(PrefillWork(seq, num_new))
            budget -= num_new

    # -- after the forward -----------------------------------------------------------------------------------

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The step computed what `out` scheduled: its tokens' K/V is in the cache, and full pages can be shared."""
        for seq in out.decodes:
            seq.num_computed_tokens += 1
        for work in out.prefills:
            work.seq.num_computed_tokens += work.num_new_tokens
        for seq in itertools.chain(out.decodes, (work.seq for work in out.prefills)):
            self.kv.hash_new_pages(seq)
            self.kv.commit_full_pages(seq)
            self.kv.release_behind_window(seq)

    def shrink_token_budget(self) -> int:
        """Halves the tokens a step may compute (after a step ran out of memory), never below one decode token for
        each of max_num_seqs sequences; returns the new budget."""
        self.policy.max_tokens = max(self.config.max_num_seqs, self.policy.max_tokens // 2)
        return self.policy.max_tokens

    # -- preemption ---------------------------------------------------------------------------------------

    @staticmethod
    def _pick_victim(candidates: list[Sequence]) -> Sequence:
        return max(candidates, key=lambda s: (s.priority, s.admission_order))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Frees `seq`'s pages and requeues it; it will be recomputed, from its cached prefix if still there."""
        out.drop(seq)
        out.preempted.append(seq)
        self.running.remove(seq)
        self._release(seq)
        self._release_held_once_drained()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Removes a finished or aborted sequence from whichever queue holds it and frees its pages."""
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if was_running and self.config.scheduling == "static" and self.running:
            self.held.append(seq)  # its batch is still running: it keeps its slot until the batch drains
            return
        self._release(seq)
        self._release_held_once_drained()

    def _release_held_once_drained(self) -> None:
        if not self.running:
            for seq in self.held:
                self._release(seq)
            self.held.clear()

    def _release(self, seq: Sequence) -> None:
        self.kv.release(seq)
        seq.num_computed_tokens = 0  # its K/V is gone; a preempted sequence is recomputed from its cached prefix

    # -- leading indicators ---------------------------------------------------------------------------------

    def projected_ttft_seconds(self, now: float | None = None) -> dict[str, float]:
        """For every waiting request, the projected seconds from its arrival to its first token.

        The prompt tokens ahead of it (running prompts first, then the waiting requests before it, then its
        own) are prefilled in steps that also carry every running decode: full steps at the token budget,
        then one partial step, each as long as the step-time model predicts. Time a request may spend
        waiting for a free slot or free pages is not foreseen. Empty until the model is warm.
        """
        model = self.policy.model
        if not model.is_warm or not self.waiting:
            return {}
        now = time.monotonic() if now is None else now
        num_decodes = len(self.running)
        budget = self.policy.token_budget(num_decodes + 1)
        ahead = sum(s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1)
        projections = {}
        for seq in self.waiting:
            ahead += seq.num_uncomputed_tokens
            seconds = prefill_seconds(model, budget, num_decodes, ahead)
            projections[seq.request_id] = (now - seq.arrival_time) + seconds
        return projections
