"""Counters the engine keeps as it steps, and the snapshot load reports and benchmarks read."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_runtime.ipc.messages import ITERATION_TOKEN_BUCKETS
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence

if TYPE_CHECKING:
    from gpu_runtime.engine import LLMEngine


@dataclass(slots=True)
class EngineStats:
    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    step_seconds: float = 0.0  # wall time inside step(), scheduling and sampling included
    prefill_step_seconds: float = 0.0  # of which in steps that computed any prompt tokens
    last_step_seconds: float = 0.0
    forward_seconds: float = 0.0  # of which inside the model forward
    peak_used_pages: int = 0
    peak_kv_waste: float = 0.0  # share of allocated page slots holding no token, at the peak
    num_preemptions: int = 0
    # Steps by how many tokens they computed, per bucket of ITERATION_TOKEN_BUCKETS (the last: beyond them all).
    iteration_token_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    iteration_tokens_sum: int = 0

    def observe_kv(self, kv: KVCacheManager, holders: list[Sequence]) -> None:
        """`holders`: every sequence that holds pages (running, and a static batch's finished ones)."""
        used = kv.num_used_pages
        if used <= self.peak_used_pages:
            return
        # A shared page counts once, as full as its fullest owner has computed it.
        fill: dict[int, int] = {}
        for seq in holders:
            for table in seq.tables:  # every KV group's
                for index, page in enumerate(table.page_ids):
                    tokens = min(kv.page_size, max(0, seq.num_computed_tokens - index * kv.page_size))
                    fill[page] = max(fill.get(page, 0), tokens)
        self.peak_used_pages = used
        self.peak_kv_waste = 1.0 - sum(fill.values()) / (used * kv.page_size)

    def observe_step(self, scheduled: SchedulerOutput, seconds: float, total_forward_seconds: float) -> None:
        self.num_steps += 1
        self.num_decode_tokens += len(scheduled.decodes)
        self.num_prefill_tokens += sum(work.num_new_tokens for work in scheduled.prefills)
        self.step_seconds += seconds
        self.last_step_seconds = seconds
        if scheduled.prefills:
            self.prefill_step_seconds += seconds
        self.forward_seconds = total_forward_seconds
        self.num_preemptions += len(scheduled.preempted)
        computed = len(scheduled.decodes) + sum(work.num_new_tokens for work in scheduled.prefills)  # no padding
        self.iteration_token_counts[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, computed)] += 1
        self.iteration_tokens_sum += computed


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What a load report carries: queues, pages, prefix cache, preemptions, step timings."""

    num_running: int
    num_waiting: int
    num_pages: int
    num_used_pages: int
    num_cached_pages: int  # pages holding registered prefix content, owned or free
    kv_cache_usage: float  # used pages / all pages
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    mean_step_ms: float
    last_step_ms: float
    # The host KV tier (kv_offload_bytes), cumulative but for its pages held now; zeros without one.
    prefix_host_hit_tokens: int = 0  # of prefix_hit_tokens, found in the host tier
    kv_offloaded_pages: int = 0
    kv_loaded_pages: int = 0
    kv_host_pages: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineSnapshot:
        kv, stats = engine.kv, engine.stats
        return cls(
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            num_pages=kv.num_pages,
            num_used_pages=kv.num_used_pages,
            num_cached_pages=kv.allocator.num_cached_pages,
            kv_cache_usage=kv.num_used_pages / kv.num_pages,
            prefix_query_tokens=kv.num_prefix_query_tokens,
            prefix_hit_tokens=kv.num_prefix_hit_tokens,
            num_preemptions=stats.num_preemptions,
            num_steps=stats.num_steps,
            mean_step_ms=1e3 * stats.step_seconds / stats.num_steps if stats.num_steps else 0.0,
            last_step_ms=1e3 * stats.last_step_seconds,
            prefix_host_hit_tokens=kv.num_host_hit_tokens,
            kv_offloaded_pages=kv.host.num_offloaded if kv.host is not None else 0,
            kv_loaded_pages=kv.host.num_loaded if kv.host is not None else 0,
            kv_host_pages=len(kv.host) if kv.host is not None else 0,
        )
