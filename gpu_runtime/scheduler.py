"""Continuous batching: each step runs every decode, then admits waiting requests while pages allow."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in the running batch at most
    max_num_batched_tokens: int = 4096  # tokens one forward computes at most
    scheduling: str = "continuous"  # or "static": a batch is admitted only once the last one has finished

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(f"scheduling: must be 'continuous' or 'static', got {self.scheduling!r}")


@dataclass(frozen=True, slots=True)
class PrefillWork:
    seq: Sequence
    num_new_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: one token per decode, a run of tokens per prefill."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[PrefillWork] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(work.num_new_tokens for work in self.prefills)


class Scheduler:
    """Owns the waiting queue and the running batch. Running is kept in admission order, so the most
    recently admitted sequence, the one preempted first, is always at its end."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._schedule_running(out)
        if not out.preempted and self._may_admit():
            self._admit_waiting(out, self.config.max_num_batched_tokens - len(out.decodes))
        return out

    def _schedule_running(self, out: SchedulerOutput) -> None:
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            # Each running sequence needs a slot for the token it computes this step.
            while not self.kv.try_reserve(seq, seq.num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return
            out.decodes.append(seq)
            index += 1

    def _may_admit(self) -> bool:
        return self.config.scheduling == "continuous" or not self.running

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> None:
        static = self.config.scheduling == "static"
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_uncomputed_tokens
            # Static batching prefills its whole batch at once; continuous keeps each step in budget,
            # but a lone prompt larger than the budget still runs rather than waiting forever.
            over_budget = num_new > token_budget and (out.prefills or out.decodes)
            if (over_budget and not static) or not self.kv.try_reserve(seq, seq.num_tokens):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(PrefillWork(seq, num_new))
            token_budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Frees `seq`'s pages and requeues it at the front; it will be recomputed from its tokens."""
        self.kv.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Removes a finished or aborted sequence from whichever queue holds it and frees its pages."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
