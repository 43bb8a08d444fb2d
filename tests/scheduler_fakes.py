"""A scripted stand-in for the scheduler processes behind a real SchedulerLink, and request sessions over it.

FakeSchedulers takes the place of the link's sockets: what the link sends is recorded, and the test answers with
deltas that go through the link's own dispatch, as a StepOutputs from the worker would. Counts are cumulative per
worker and request, as a scheduler counts them (its prompt is the prompt it was sent).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import structlog
from link_fixtures import MODEL, ready_link

from common.lanes import Role
from frontend.admission import AdmissionController
from frontend.metering import Meter
from frontend.metrics import FrontendMetrics
from frontend.request_session import RequestSession, SessionRequest, SessionServices
from frontend.request_stream import ChunkBuilder
from frontend.scheduler_link import SchedulerLink, SchedulerState
from frontend.spec import AdmissionSpec
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import AbortRequests, AddRequest, KVTransferParams, RequestDelta, StepOutputs
from gpu_runtime.ipc.sampling_params import SamplingParams


class _LetterBackend:
    """A tokenizer backend whose token t is the letter chr(97 + t % 26)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


class LetterTokenizer:
    backend = _LetterBackend()

    def token_text(self, token_id: int) -> str:
        return chr(97 + token_id % 26)


@dataclass
class _Running:
    message: AddRequest
    output_tokens: int = 0


class FakeSchedulers:
    """Every worker of a link, scripted: `emit` sends a worker's delta for a request it runs."""

    def __init__(self, link: SchedulerLink, answer_aborts: bool = True):
        self.link = link
        self.sent: list[tuple[SchedulerState, object]] = []
        self.running: dict[tuple[str, str], _Running] = {}  # (worker id, request id) -> what it was sent
        self._answer_aborts = answer_aborts  # an abort of a running request ends it with a final ABORT delta
        link._send = self._receive

    def added(self, worker: SchedulerState) -> list[AddRequest]:
        return [m for s, m in self.sent if s is worker and isinstance(m, AddRequest)]

    def aborted(self, worker: SchedulerState) -> list[str]:
        return [i for s, m in self.sent if s is worker and isinstance(m, AbortRequests) for i in m.request_ids]

    def runs(self, worker: SchedulerState, request_id: str) -> bool:
        return (worker.address.worker_id, request_id) in self.running

    def emit(self, worker: SchedulerState, request_id: str, tokens: list[int], finish: FinishReason | None = None,
             *, cached: int = 0, handover: KVTransferParams | None = None, migrate: bool = False) -> None:  # fmt: skip
        key = (worker.address.worker_id, request_id)
        running = self.running[key]
        running.output_tokens += len(tokens)
        delta = RequestDelta(request_id, tokens, None, finish, len(running.message.prompt_token_ids),
                             running.output_tokens, cached, handover=handover, migrate=migrate)  # fmt: skip
        if finish is not None:
            del self.running[key]
        self.link._dispatch(worker, StepOutputs(worker.address.worker_id, "1", [delta]))

    def lose(self, worker: SchedulerState) -> None:
        """The worker's process died: the link notices, and what it ran is gone."""
        self.running = {key: r for key, r in self.running.items() if key[0] != worker.address.worker_id}
        self.link._lose(worker, f"the scheduler of model {worker.address.model_name!r} stopped; retry")

    def _receive(self, worker: SchedulerState, message) -> None:
        self.sent.append((worker, message))
        if isinstance(message, AddRequest):
            self.running[(worker.address.worker_id, message.request_id)] = _Running(message)
        elif isinstance(message, AbortRequests) and self._answer_aborts:
            for request_id in message.request_ids:
                if self.runs(worker, request_id):  # as a scheduler does, between two steps
                    asyncio.get_running_loop().call_soon(self._abort, worker, request_id)

    def _abort(self, worker: SchedulerState, request_id: str) -> None:
        if self.runs(worker, request_id):
            self.emit(worker, request_id, [], FinishReason.ABORT)


class FakeLedger:
    """The usage ledger's interface, keeping every committed row."""

    def __init__(self) -> None:
        self.commits: list = []

    def checkpoint(self, records) -> None:
        pass

    async def commit(self, record) -> None:
        self.commits.append(record)

    def settle_interrupted(self, *args) -> None:
        pass


@dataclass
class Frontend:
    """The frontend's request side over fake schedulers: a link, admission, metering and session services."""

    link: SchedulerLink
    schedulers: FakeSchedulers
    services: SessionServices
    ledger: FakeLedger
    released: list[str] = field(default_factory=list)

    def session(self, prompt_tokens: int = 8, max_tokens: int = 5, stop: list[str] | None = None,
                record_id: str = "rec-1", **sampling) -> RequestSession:  # fmt: skip
        message = AddRequest(record_id, list(range(1, prompt_tokens + 1)),
                             SamplingParams(max_tokens=max_tokens, **sampling), Priority.INTERACTIVE)  # fmt: skip
        builder = ChunkBuilder(record_id, MODEL, LetterTokenizer(), stop or [])
        request = SessionRequest(record_id, record_id, None, MODEL, Priority.INTERACTIVE, message, builder, 0.0)
        return RequestSession(self.services, request, on_released=lambda: self.released.append(record_id))

    def close(self) -> None:
        self.services.admission.close()
        self.link.close()


def fake_frontend(roles: list[Role], disagg_min_prompt_tokens: int = 4) -> Frontend:
    """A frontend whose workers have `roles` (call close() after use); must be made inside a running loop."""
    link = ready_link(len(roles), roles)
    metrics = FrontendMetrics()
    log = structlog.get_logger()
    ledger = FakeLedger()
    admission = AdmissionController(link, AdmissionSpec(), metrics, tenants=[])
    services = SessionServices(link, admission, Meter(ledger, metrics, log), metrics, log, disagg_min_prompt_tokens,
                               settle_timeout_s=5.0, migrate_wait_s=5.0)  # fmt: skip
    return Frontend(link, FakeSchedulers(link), services, ledger)
