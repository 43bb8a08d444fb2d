"""Meter: the usage of every admitted request, as its scheduler counted it, in the ledger and in metrics alike."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass

from frontend.metrics import FrontendMetrics
from frontend.usage_ledger import UsageLedger, UsageRecord
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import RequestDelta

CHECKPOINT_EVERY_S = 1.0


@dataclass(frozen=True, slots=True)
class TokenCounts:
    """What a request cost so far, as its schedulers counted it, summed over the workers it ran on."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed


def status_of(finish_reason: FinishReason) -> str:
    """A request that ran to its end finished; one ended by an abort was cancelled."""
    return "cancelled" if finish_reason is FinishReason.ABORT else "finished"


class Meter:
    def __init__(self, ledger: UsageLedger, metrics: FrontendMetrics, log):
        self._ledger = ledger
        self._metrics = metrics
        self._log = log
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:12]  # record ids stay unique across frontend restarts
        self._running: dict[str, UsageRecord] = {}
        self._none_running = asyncio.Event()
        self._none_running.set()

    def new_record_id(self) -> str:
        """The id of a request's usage record, and the id its scheduler knows it by: unique across restarts."""
        return f"{self._prefix}-{next(self._ids)}"

    def open(self, record_id: str, request_id: str, tenant: str | None, model: str, priority: Priority) -> UsageRecord:
        now = time.time()
        record = UsageRecord(
            record_id=record_id,
            request_id=request_id,
            tenant=tenant or "",
            model=model,
            priority=priority.label,
            status="running",
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            started_at=now,
            updated_at=now,
        )
        self._running[record.record_id] = record
        self._none_running.clear()
        self._ledger.checkpoint([record])
        return record

    def progress(self, record: UsageRecord, counts: TokenCounts | None) -> None:
        """The schedulers' latest cumulative counts (None: they have said nothing yet) become the record's."""
        if counts is not None:
            record.prompt_tokens, record.completion_tokens = counts.prompt_tokens, counts.completion_tokens
            record.cached_tokens = counts.cached_tokens
        record.updated_at = time.time()

    async def record_shed(
        self, record_id: str, request_id: str, tenant: str | None, model: str, priority: Priority
    ) -> None:
        """A request refused under pressure is in the ledger too, with nothing computed."""
        record = self.open(record_id, request_id, tenant, model, priority)
        await self.close(record, "shed", None, None)

    async def close(
        self, record: UsageRecord, status: str, finish_reason: FinishReason | None, counts: TokenCounts | None
    ) -> None:
        """Commits the final row (once) and counts it in the metrics with the very same numbers.

        `finish_reason` is None for a request that never ran (shed); `counts` are its schedulers' final ones."""
        if record.status != "running":
            return
        self.progress(record, counts)
        record.status, record.finished_at = status, record.updated_at
        self._running.pop(record.record_id, None)
        if not self._running:
            self._none_running.set()
        await self._ledger.commit(record)
        labels = (record.tenant, record.model)
        m = self._metrics
        m.tenant_requests.labels(*labels, status).inc()
        m.tenant_prompt_tokens.labels(*labels).inc(record.prompt_tokens)
        m.tenant_completion_tokens.labels(*labels).inc(record.completion_tokens)
        m.tenant_cached_tokens.labels(*labels).inc(record.cached_tokens)
        m.prompt_tokens.labels(record.model).inc(record.prompt_tokens)
        m.generation_tokens.labels(record.model).inc(record.completion_tokens)
        if finish_reason is not None:
            m.request_success.labels(record.model, finish_reason).inc()
        self._log.info(
            "request_finished",
            request_id=record.request_id,
            tenant=record.tenant,
            status=status,
            finish_reason=finish_reason,
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            cached_tokens=record.cached_tokens,
        )

    def settle_orphan(self, delta: RequestDelta) -> None:
        """A request of a frontend that died ended on its scheduler: its row (marked interrupted at our start, with
        the counts of its last checkpoint) gets the scheduler's final counts."""
        self._ledger.settle_interrupted(delta.request_id, delta.num_prompt_tokens, delta.num_output_tokens,
                                        delta.num_cached_tokens)  # fmt: skip
        self._log.info(
            "orphan_settled",
            record_id=delta.request_id,
            prompt_tokens=delta.num_prompt_tokens,
            completion_tokens=delta.num_output_tokens,
        )

    async def settled(self, timeout: float) -> bool:
        """Waits until every open record has its final row (a cancelled or aborted stream's final counts come from
        its scheduler after the stream ended), at most `timeout` seconds; whether all did."""
        try:
            await asyncio.wait_for(self._none_running.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def checkpoint_forever(self) -> None:
        """Every second, the counts so far of every running request reach the ledger."""
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY_S)
            if self._running:
                self._ledger.checkpoint(list(self._running.values()))
