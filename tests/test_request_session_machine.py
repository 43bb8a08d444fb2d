"""The request session under any order of its events (a worker's deltas, a handover, a migration, a drain, a lost
worker, the client going away): the client sees at most one final chunk, usage never decreases, the ledger row is
closed exactly once with counts no lower than the client saw, and every slot is given back."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_fakes import fake_frontend
from test_request_session import PAGES, Client

from common.lanes import Role, WorkerState
from gpu_runtime.ipc.enums import FinishReason

pytestmark = pytest.mark.fast

_TURNS = 50  # loop turns after each event: enough for the session to react to it


class SessionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.frontend = self._run(self._start())

    async def _start(self):
        frontend = fake_frontend([Role.PREFILL, Role.DECODE, Role.DECODE])
        frontend.services.migrate_wait_s = 0.0
        self.session = frontend.session(max_tokens=6)
        await self.session.admit()
        self.client = Client(self.session)
        return frontend

    def _run(self, coroutine):
        return self.loop.run_until_complete(coroutine)

    async def _turns(self) -> None:
        for _ in range(_TURNS):
            await asyncio.sleep(0)

    async def _settled(self) -> None:
        await asyncio.gather(*self.frontend.services.settling)

    def _current(self):
        """The worker that runs the request now (None once no worker does)."""
        fake = self.frontend.schedulers
        return next((s for s in self.frontend.link.schedulers if fake.runs(s, "rec-1")), None)

    def _emit(self, *args, **fields) -> None:
        self.frontend.schedulers.emit(self._current(), "rec-1", *args, **fields)
        self._run(self._turns())

    def _on_prefill(self) -> bool:
        worker = self._current()
        return worker is not None and worker.role is Role.PREFILL

    @precondition(lambda self: self._current() is not None and not self._on_prefill())
    @rule(count=st.integers(1, 3))
    def tokens(self, count):
        running = self.frontend.schedulers.running[(self._current().address.worker_id, "rec-1")]
        room = running.message.sampling.max_tokens - running.output_tokens
        count = min(count, room)
        self._emit([5] * count, FinishReason.LENGTH if count == room else None)

    @precondition(lambda self: self._current() is not None)
    @rule()
    def stop_token(self):
        self._emit([2], FinishReason.STOP)

    @precondition(lambda self: self._on_prefill())
    @rule()
    def hand_over(self):
        self._emit([7], FinishReason.LENGTH, handover=PAGES)

    @precondition(lambda self: self._current() is not None)
    @rule()
    def drain_timeout_migrates(self):
        self._current().worker_state = WorkerState.DRAINING
        self._emit([], FinishReason.ABORT, migrate=True)

    @rule(index=st.integers(0, 2))
    def drain(self, index):
        self.frontend.link.schedulers[index].worker_state = WorkerState.DRAINING

    @precondition(lambda self: self._current() is not None)
    @rule()
    def lose_worker(self):
        self.frontend.schedulers.lose(self._current())
        self._run(self._turns())

    @rule()
    def client_goes_away(self):
        self._run(self.client.cancel())
        self._run(self._turns())

    @invariant()
    def at_most_one_final_chunk(self):
        assert len(self.client.finishes) <= 1

    @invariant()
    def usage_never_decreases(self):
        seen = [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.cached_tokens) for c in self.client.chunks]
        assert all(a[1] <= b[1] and a[0] <= b[0] for a, b in zip(seen, seen[1:], strict=False)), seen

    @invariant()
    def at_most_one_ledger_row(self):
        assert len(self.frontend.ledger.commits) <= 1

    def teardown(self):
        try:
            self._run(self.client.cancel())
            self._run(self._settled())
            (row,) = self.frontend.ledger.commits
            if self.client.chunks:
                assert row.completion_tokens >= self.client.chunks[-1].usage.completion_tokens
            assert self.frontend.released == ["rec-1"]
            assert all(s.reserved == 0 and not s.requests for s in self.frontend.link.schedulers)
        finally:
            self.frontend.close()
            self._run(self._turns())  # admission's expiry task sees its cancellation
            self.loop.close()


SessionMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=12, deadline=None)
test_request_session_machine = SessionMachine.TestCase
