"""tokend.v1.Generation in process, over scripted schedulers: a request streams its chunks behind its headers, a
request id already in flight is refused, and Abort ends the caller's own request with its final counts metered."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from scheduler_fakes import LetterTokenizer, fake_frontend
from test_request_session import until

from common.lanes import Role
from frontend.generation_service import GenerationService
from frontend.lifecycle import Lifecycle
from frontend.models import ModelCatalog
from frontend.tokenize_pool import TokenizePool
from gpu_runtime.ipc.enums import FinishReason
from tokend.v1 import tokend_pb2 as pb

pytestmark = pytest.mark.fast


class LetterCatalog(ModelCatalog):
    def tokenizer(self, ready):
        return LetterTokenizer()


class Context:
    """The parts of grpc.aio.ServicerContext the handler uses."""

    def __init__(self) -> None:
        self.metadata = None
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def send_initial_metadata(self, metadata) -> None:
        self.metadata = dict(metadata)

    async def abort(self, code, message, trailing_metadata=()):
        self.aborted = (code, message)
        raise grpc.aio.AbortError()


def _request(request_id: str = "r1", max_tokens: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), request_id=request_id,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0))  # fmt: skip


async def _collect(service, request, context) -> list[pb.GenerateResponse]:
    chunks = []
    try:
        async for chunk in service.Generate(request, context):
            chunks.append(chunk)
    except grpc.aio.AbortError:
        pass
    return chunks


def run_service(test):
    async def body():
        frontend = fake_frontend([Role.MIXED])
        services = frontend.services
        tokenize = TokenizePool()
        models, lifecycle = LetterCatalog(frontend.link, "llama"), Lifecycle(None, frontend.link)
        service = GenerationService(frontend.link, models, lifecycle, services.metrics, services.meter,
                                    services.admission, tokenize, services.log)  # fmt: skip
        try:
            await test(frontend, service)
        finally:
            tokenize.close()
            frontend.close()

    asyncio.run(body())


def test_a_request_streams_behind_its_headers_and_leaves_one_ledger_row():
    @run_service
    async def scenario(frontend, service):
        context = Context()
        reading = asyncio.create_task(_collect(service, _request(), context))
        (worker,) = frontend.link.schedulers
        await until(lambda: frontend.schedulers.added(worker))
        record_id = frontend.schedulers.added(worker)[0].request_id
        frontend.schedulers.emit(worker, record_id, [0, 1, 2], FinishReason.LENGTH)
        chunks = await reading
        assert context.metadata == {"x-request-id": "r1", "x-model": "llama"}
        assert "".join(c.text for c in chunks) == "abc" and chunks[-1].finish_reason == "length"
        assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 3
        (row,) = frontend.ledger.commits
        assert (row.request_id, row.status, row.completion_tokens) == ("r1", "finished", 3)


def test_a_request_id_in_flight_is_refused_and_abort_ends_it():
    @run_service
    async def scenario(frontend, service):
        (worker,) = frontend.link.schedulers
        first = asyncio.create_task(_collect(service, _request(max_tokens=8), Context()))
        await until(lambda: frontend.schedulers.added(worker))
        again = Context()
        assert await _collect(service, _request(max_tokens=8), again) == []
        assert again.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT and "already in flight" in again.aborted[1]
        record_id = frontend.schedulers.added(worker)[0].request_id
        frontend.schedulers.emit(worker, record_id, [0])
        reply = await service.Abort(pb.AbortRequest(request_id="r1"), Context())
        assert reply.aborted
        chunks = await first
        assert chunks[-1].finish_reason == "abort" and chunks[-1].usage.completion_tokens == 1
        (row,) = frontend.ledger.commits
        assert (row.status, row.completion_tokens) == ("cancelled", 1)
        assert not (await service.Abort(pb.AbortRequest(request_id="r1"), Context())).aborted
