"""Counters the engine keeps as it steps: cheap to update, read by benchmarks and load reports."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    step_seconds: float = 0.0  # wall time inside step(), scheduling and sampling included
    prefill_step_seconds: float = 0.0  # of which in steps that computed any prompt tokens
    forward_seconds: float = 0.0  # of which inside the model forward
    peak_used_pages: int = 0
    peak_kv_waste: float = 0.0  # share of allocated page slots holding no token, at the peak
    num_preemptions: int = 0

    def observe_kv(self, kv: KVCacheManager, scheduled: list[Sequence], num_new_tokens: int) -> None:
        used = kv.num_used_pages
        if used <= self.peak_used_pages:
            return
        # After this step every scheduled sequence holds all its tokens in the cache.
        tokens_held = sum(seq.num_tokens for seq in scheduled)
        self.peak_used_pages = used
        self.peak_kv_waste = 1.0 - tokens_held / (used * kv.page_size)

    def observe_step(self, scheduled: SchedulerOutput, seconds: float, total_forward_seconds: float) -> None:
        self.num_steps += 1
        self.num_decode_tokens += len(scheduled.decodes)
        self.num_prefill_tokens += scheduled.num_tokens - len(scheduled.decodes)
        self.step_seconds += seconds
        if scheduled.prefills:
            self.prefill_step_seconds += seconds
        self.forward_seconds = total_forward_seconds
        self.num_preemptions += len(scheduled.preempted)
