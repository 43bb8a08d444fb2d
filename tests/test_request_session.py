"""A request's life in the frontend, over scripted schedulers: one worker, a P/D handover, a migration off a
retired worker, an abort at every point, worker loss and stop strings; the client sees one stream with exact,
cumulative usage, and the ledger gets exactly one row with the schedulers' counts."""

from __future__ import annotations

import asyncio

import grpc
import msgspec
import pytest
from link_fixtures import prefill_kv_address
from scheduler_fakes import fake_frontend

from common.lanes import Role, WorkerState
from frontend.errors import RequestError
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import KVTransferParams

pytestmark = pytest.mark.fast

# Where the prefill worker (llama/0) said in its ready it serves pulls: the only address a handover may name.
PAGES = KVTransferParams("llama/0", "rec-1", prefill_kv_address("0"), [3, 4], [b"a", b"b"], 32)


async def until(condition, steps: int = 200) -> None:
    """Lets the loop run until `condition()` holds (the session reacts to each delta within a few turns)."""
    for _ in range(steps):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


class Client:
    """Reads a session's chunks as a gRPC handler would, and ends it the way Generate does."""

    def __init__(self, session):
        self.session = session
        self.chunks = []
        self.error: RequestError | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        outcome = "cancelled"
        try:
            async for chunk in self.session.chunks():
                self.chunks.append(chunk)
        except RequestError as error:
            self.error, outcome = error, "error"
        finally:
            self.session.finish(outcome)

    async def cancel(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def finishes(self) -> list[str]:
        return [c.finish_reason for c in self.chunks if c.finish_reason]

    @property
    def usage(self) -> tuple[int, int, int]:
        u = self.chunks[-1].usage
        return u.prompt_tokens, u.completion_tokens, u.cached_tokens


async def settled(frontend) -> None:
    await asyncio.gather(*frontend.services.settling)


def run(test):
    """Runs an async test body with a fresh frontend of `roles` (mixed, mixed by default)."""

    def wrapper(roles=(Role.MIXED, Role.MIXED)):
        async def body():
            frontend = fake_frontend(list(roles))
            try:
                await test(frontend)
            finally:
                frontend.close()

        asyncio.run(body())

    return wrapper


def test_a_whole_request_streams_its_tokens_and_is_metered_once():
    @run
    async def scenario(frontend):
        session = frontend.session(max_tokens=5)
        await session.admit()
        (worker,) = [s for s in frontend.link.schedulers if frontend.schedulers.added(s)]
        client = Client(session)
        frontend.schedulers.emit(worker, "rec-1", [0, 1, 2])
        frontend.schedulers.emit(worker, "rec-1", [3, 4], FinishReason.LENGTH)
        await client.task
        assert client.text == "abcde" and client.finishes == ["length"] and client.usage == (8, 5, 0)
        (row,) = frontend.ledger.commits
        assert (row.status, row.prompt_tokens, row.completion_tokens) == ("finished", 8, 5)
        assert frontend.released == ["rec-1"] and not worker.requests and worker.reserved == 0

    scenario()


async def _handed_over(frontend, max_tokens: int = 5):
    prefill, decode = frontend.link.schedulers
    session = frontend.session(max_tokens=max_tokens)
    await session.admit()
    (first,) = frontend.schedulers.added(prefill)
    assert first.do_remote_decode and first.sampling.max_tokens == 1
    assert decode.reserved == 1  # its slot is held while the prompt runs on the prefill worker
    client = Client(session)
    frontend.schedulers.emit(prefill, "rec-1", [7], FinishReason.LENGTH, cached=2, handover=PAGES)
    await until(lambda: frontend.schedulers.added(decode))
    return session, client, prefill, decode


def test_a_handover_sends_the_rest_to_the_decode_worker_and_the_client_sees_one_stream():
    @run
    async def scenario(frontend):
        session, client, prefill, decode = await _handed_over(frontend)
        (rest,) = frontend.schedulers.added(decode)
        assert rest.kv_transfer_params == PAGES and not rest.do_remote_decode
        assert rest.prompt_token_ids == [*range(1, 9), 7] and rest.sampling.max_tokens == 4
        assert decode.reserved == 0 and "rec-1" in decode.requests and "rec-1" not in prefill.requests
        frontend.schedulers.emit(decode, "rec-1", [8, 9], cached=8)
        await until(lambda: len(client.chunks) == 2)
        frontend.schedulers.emit(decode, "rec-1", [10, 11], FinishReason.LENGTH, cached=8)
        await client.task
        assert [c.finish_reason for c in client.chunks] == ["", "", "length"]  # the handover is not an end
        assert [c.usage.completion_tokens for c in client.chunks] == [1, 3, 5]
        assert client.usage == (8, 5, 2)  # the prompt as the prefill worker counted it, every token generated
        assert [h.kind.value for h in session.hops] == ["prefill", "decode"]
        (row,) = frontend.ledger.commits
        assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (8, 5, 2)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_first_token_that_ends_the_request_on_the_prefill_worker_gives_the_decode_slot_back():
    @run
    async def scenario(frontend):
        prefill, decode = frontend.link.schedulers
        session = frontend.session()
        await session.admit()
        client = Client(session)
        frontend.schedulers.emit(prefill, "rec-1", [7], FinishReason.STOP)
        await client.task
        assert client.finishes == ["stop"] and decode.reserved == 0 and not frontend.schedulers.added(decode)
        assert len(frontend.ledger.commits) == 1

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_short_prompt_or_a_seeded_request_runs_whole_on_the_decode_worker():
    @run
    async def scenario(frontend):
        prefill, decode = frontend.link.schedulers
        for record_id, session in (("a", frontend.session(prompt_tokens=2, record_id="a")),
                                   ("b", frontend.session(record_id="b", seed=3))):  # fmt: skip
            await session.admit()
            assert [m.request_id for m in frontend.schedulers.added(decode)][-1] == record_id
            assert session.hops[0].kind.value == "whole"
        assert not frontend.schedulers.added(prefill)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_retired_workers_stream_migrates_and_goes_on_elsewhere():
    @run
    async def scenario(frontend):
        session = frontend.session(max_tokens=5)
        await session.admit()
        first = next(s for s in frontend.link.schedulers if frontend.schedulers.added(s))
        other = next(s for s in frontend.link.schedulers if s is not first)
        client = Client(session)
        frontend.schedulers.emit(first, "rec-1", [0, 1])
        frontend.schedulers.emit(first, "rec-1", [], FinishReason.ABORT, migrate=True)  # its drain timed out
        await until(lambda: frontend.schedulers.added(other))
        (rest,) = frontend.schedulers.added(other)
        assert rest.prompt_token_ids == [*range(1, 9), 0, 1] and rest.sampling.max_tokens == 3
        frontend.schedulers.emit(other, "rec-1", [2, 3, 4], FinishReason.LENGTH)
        await client.task
        assert client.text == "abcde" and client.finishes == ["length"] and client.usage == (8, 5, 0)
        assert client.chunks[-1].migrated and [h.kind.value for h in session.hops] == ["whole", "migrated"]
        assert len(frontend.ledger.commits) == 1

    scenario()


def test_a_stream_its_retired_worker_aborts_at_the_drain_timeout_ends_abort_billed_to_those_weights():
    """on_drain_timeout abort (test_rollout.py's daemon case [abort] moved here; the scheduler's side is in
    test_scheduler_drain.py): the retired worker's final ABORT delta, not marked migrate, ends the client's stream
    with finish_reason abort, on no other worker; the ledger bills exactly the tokens the client got, cancelled,
    and names the weights that made them."""

    @run
    async def scenario(frontend):
        for worker in frontend.link.schedulers:
            worker.ready = msgspec.structs.replace(worker.ready, generation=f"weights-{worker.address.group}")
        session = frontend.session(max_tokens=5)
        await session.admit()
        first = next(s for s in frontend.link.schedulers if frontend.schedulers.added(s))
        other = next(s for s in frontend.link.schedulers if s is not first)
        client = Client(session)
        frontend.schedulers.emit(first, "rec-1", [0, 1])
        first.worker_state = WorkerState.DRAINING  # a rollout retires it
        frontend.schedulers.emit(first, "rec-1", [], FinishReason.ABORT)  # its drain timed out: abort
        await client.task
        await settled(frontend)
        assert client.text == "ab" and client.finishes == ["abort"] and client.usage == (8, 2, 0)
        assert not client.chunks[-1].migrated and not frontend.schedulers.added(other)
        assert {c.generation for c in client.chunks} == {first.generation}
        (row,) = frontend.ledger.commits
        assert (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", 8, 2)
        assert row.generation == first.generation and [h.kind.value for h in session.hops] == ["whole"]

    scenario()


def test_a_request_cancelled_while_it_waits_for_admission_sends_nothing_and_meters_nothing():
    @run
    async def scenario(frontend):
        for worker in frontend.link.schedulers:
            worker.requests.update(f"busy-{i}" for i in range(8))  # every slot taken
        session = frontend.session()
        waiting = asyncio.create_task(session.admit())
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        session.finish("cancelled")
        assert not frontend.schedulers.sent and not frontend.ledger.commits and frontend.released == ["rec-1"]

    scenario()


def test_a_request_cancelled_during_its_prefill_is_aborted_there_and_holds_no_decode_slot():
    @run
    async def scenario(frontend):
        prefill, decode = frontend.link.schedulers
        session = frontend.session()
        await session.admit()
        client = Client(session)
        await asyncio.sleep(0)
        await client.cancel()
        await settled(frontend)
        assert frontend.schedulers.aborted(prefill) == ["rec-1"] and not frontend.schedulers.added(decode)
        (row,) = frontend.ledger.commits
        assert (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", 8, 0)
        assert decode.reserved == 0 and frontend.released == ["rec-1"]

    scenario(roles=(Role.PREFILL, Role.DECODE))


@pytest.mark.parametrize(
    "pages",
    [
        msgspec.structs.replace(PAGES, remote_address="ipc:///tmp/not-a-worker.ipc"),  # no worker serves pulls there
        msgspec.structs.replace(PAGES, remote_engine_id="llama/1"),  # pages said to be another worker's
    ],
    ids=["foreign-address", "another-engine"],
)
def test_a_handover_naming_pages_anywhere_but_its_prefill_workers_kv_address_is_computed_whole(pages):
    """A decode worker stores the pages it pulls under the request's cache salt: it is sent to pull only from the
    address the prefill worker's genuine ready named; otherwise it computes the whole prompt, exactly."""

    @run
    async def scenario(frontend):
        prefill, decode = frontend.link.schedulers
        session = frontend.session(max_tokens=3)
        await session.admit()
        client = Client(session)
        frontend.schedulers.emit(prefill, "rec-1", [7], FinishReason.LENGTH, handover=pages)
        await until(lambda: frontend.schedulers.added(decode))
        (rest,) = frontend.schedulers.added(decode)
        assert rest.kv_transfer_params is None and rest.prompt_token_ids == [*range(1, 9), 7]
        assert frontend.schedulers.aborted(prefill) == ["rec-1"]  # which releases whatever lease it holds
        frontend.schedulers.emit(decode, "rec-1", [8, 9], FinishReason.LENGTH)
        await client.task
        assert client.text == "hij" and client.finishes == ["length"] and client.usage == (8, 3, 0)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_request_cancelled_at_its_handover_is_aborted_on_the_decode_worker_and_metered_once():
    @run
    async def scenario(frontend):
        session, client, prefill, decode = await _handed_over(frontend)
        await until(lambda: client.chunks)
        await client.cancel()
        await settled(frontend)
        assert frontend.schedulers.aborted(decode) == ["rec-1"]
        (row,) = frontend.ledger.commits
        assert (row.status, row.completion_tokens) == ("cancelled", 1)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_client_gone_before_the_handover_arrives_is_metered_with_the_prefill_workers_counts():
    @run
    async def scenario(frontend):
        frontend.schedulers._answer_aborts = False  # the prefill worker finishes first: its abort comes too late
        prefill, decode = frontend.link.schedulers
        session = frontend.session()
        await session.admit()
        client = Client(session)
        await asyncio.sleep(0)
        await client.cancel()
        frontend.schedulers.emit(prefill, "rec-1", [7], FinishReason.LENGTH, handover=PAGES)
        await settled(frontend)
        assert frontend.schedulers.aborted(prefill) == ["rec-1"]  # which releases the lease there
        assert not frontend.schedulers.added(decode)
        (row,) = frontend.ledger.commits
        assert (row.status, row.completion_tokens) == ("cancelled", 1)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_tokens_generated_after_the_client_left_are_metered_from_the_final_counts():
    @run
    async def scenario(frontend):
        session, client, prefill, decode = await _handed_over(frontend)
        frontend.schedulers._answer_aborts = False
        frontend.schedulers.emit(decode, "rec-1", [1, 2])
        await until(lambda: len(client.chunks) == 2)
        await client.cancel()
        frontend.schedulers.emit(decode, "rec-1", [3])  # generated before the abort took effect
        frontend.schedulers.emit(decode, "rec-1", [], FinishReason.ABORT)
        await settled(frontend)
        (row,) = frontend.ledger.commits
        assert (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", 8, 4)

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_stop_string_ends_the_stream_and_aborts_the_rest_of_the_generation():
    @run
    async def scenario(frontend):
        session = frontend.session(max_tokens=10, stop=["c"])
        await session.admit()
        worker = next(s for s in frontend.link.schedulers if frontend.schedulers.added(s))
        client = Client(session)
        frontend.schedulers.emit(worker, "rec-1", [0, 1, 2, 3])
        await client.task
        assert client.text == "ab" and client.finishes == ["stop"]
        assert frontend.schedulers.aborted(worker) == ["rec-1"]
        (row,) = frontend.ledger.commits
        assert (row.status, row.completion_tokens) == ("finished", 4)

    scenario()


def test_a_stop_string_in_the_first_token_releases_the_lease_instead_of_handing_over():
    @run
    async def scenario(frontend):
        prefill, decode = frontend.link.schedulers
        session = frontend.session(stop=["h"])
        await session.admit()
        client = Client(session)
        frontend.schedulers.emit(prefill, "rec-1", [7], FinishReason.LENGTH, handover=PAGES)
        await client.task
        assert client.finishes == ["stop"] and not frontend.schedulers.added(decode) and decode.reserved == 0
        assert frontend.schedulers.aborted(prefill) == ["rec-1"]

    scenario(roles=(Role.PREFILL, Role.DECODE))


def test_a_lost_worker_fails_the_stream_unavailable_and_meters_what_it_said():
    @run
    async def scenario(frontend):
        session = frontend.session()
        await session.admit()
        worker = next(s for s in frontend.link.schedulers if frontend.schedulers.added(s))
        client = Client(session)
        frontend.schedulers.emit(worker, "rec-1", [0, 1])
        await until(lambda: client.chunks)
        frontend.schedulers.lose(worker)
        await client.task
        await settled(frontend)
        assert client.error.code == grpc.StatusCode.UNAVAILABLE and client.finishes == []
        (row,) = frontend.ledger.commits
        assert (row.status, row.completion_tokens) == ("error", 2)

    scenario()


@pytest.mark.parametrize("retryable", [True, False])
def test_a_refused_request_fails_with_the_schedulers_reason(retryable):
    @run
    async def scenario(frontend):
        session = frontend.session()
        await session.admit()
        worker = next(s for s in frontend.link.schedulers if frontend.schedulers.added(s))
        client = Client(session)
        running = frontend.schedulers.running.pop((worker.address.worker_id, "rec-1"))
        from gpu_runtime.ipc.messages import RequestDelta, StepOutputs

        refusal = RequestDelta("rec-1", [], None, FinishReason.ERROR, len(running.message.prompt_token_ids), 0, 0,
                               "out of memory", retryable=retryable)  # fmt: skip
        frontend.link._dispatch(worker, StepOutputs(worker.address.worker_id, "1", [refusal]))
        await client.task
        expected = grpc.StatusCode.UNAVAILABLE if retryable else grpc.StatusCode.INVALID_ARGUMENT
        assert client.error.code == expected and len(frontend.ledger.commits) == 1

    scenario()


def test_a_continuation_scores_the_prompt_only_if_no_token_came_yet():
    """Prompt logprobs come with the first token: a handover's or migration's next worker is not asked for them
    again (it would score the prompt plus the tokens so far), unless nothing had been generated before the move."""
    from frontend.migration import Carryover
    from gpu_runtime.ipc.enums import Priority
    from gpu_runtime.ipc.messages import AddRequest, RequestDelta
    from gpu_runtime.ipc.sampling_params import SamplingParams

    original = AddRequest("rec-1", [1, 2, 3], SamplingParams(max_tokens=5, prompt_logprobs=2), Priority.INTERACTIVE)
    carry = Carryover(original)
    assert carry.continuation().sampling.prompt_logprobs == 2  # moved before its first token: still to score
    carry.count([RequestDelta("rec-1", [7], None, None, 3, 1, 0)])
    moved = carry.continuation(PAGES)
    assert moved.sampling.prompt_logprobs is None and moved.prompt_token_ids == [1, 2, 3, 7]
