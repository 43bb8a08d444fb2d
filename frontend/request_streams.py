"""The frontend's in-flight request streams: which worker each request is on now, and the queue its deltas go to.

A stream follows its request across workers (a P/D handover, a migration): it is on one worker at a time, and only
that worker's deltas reach its queue. Deltas for requests nobody reads are sorted out here, for the link to abort
(still running) or to meter (a final delta of a request this frontend does not know).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from frontend.worker_view import SchedulerState
from gpu_runtime.ipc.messages import RequestDelta


class SchedulerLost:
    """Put in a request's queue when its scheduler died or the frontend gave up on it."""

    def __init__(self, reason: str):
        self.reason = reason


@dataclass(eq=False)
class RequestStream:
    request_id: str  # the id the workers know it by (its usage record's)
    scheduler: SchedulerState  # the worker it runs on now
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # RequestDelta | SchedulerLost
    finished: bool = False  # its current worker sent its final delta
    lost: bool = False  # its worker died (or the frontend gave up on it): no final delta will come


class RequestStreams:
    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def open(self, request_id: str, worker: SchedulerState) -> RequestStream:
        stream = self._streams[request_id] = RequestStream(request_id, worker)
        worker.requests.add(request_id)
        return stream

    def move(self, stream: RequestStream, worker: SchedulerState) -> None:
        """The request goes on on `worker`: only its deltas count from now on."""
        stream.scheduler.requests.discard(stream.request_id)
        stream.scheduler, stream.finished = worker, False
        worker.requests.add(stream.request_id)

    def forget(self, stream: RequestStream) -> None:
        """Nobody reads the stream any more (deltas that still arrive for it are dropped)."""
        self._streams.pop(stream.request_id, None)
        stream.scheduler.requests.discard(stream.request_id)

    def deliver(self, worker: SchedulerState, deltas: list[RequestDelta]) -> tuple[list[str], list[RequestDelta]]:
        """Queues each delta on its stream; returns the ids of requests running on `worker` that nobody reads
        (to abort) and the final deltas of requests this frontend does not know (to meter)."""
        unread, unknown_finals = [], []
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None or stream.scheduler is not worker:
                if delta.finish_reason is None:
                    unread.append(delta.request_id)  # nobody reads it: stop computing it
                elif stream is None:
                    unknown_finals.append(delta)
                continue
            stream.queue.put_nowait(delta)
            if delta.finished:
                stream.finished = True
        return unread, unknown_finals

    def awaits_deltas(self, worker: SchedulerState) -> bool:
        """Whether some stream on `worker` still expects a delta from it."""
        streams = (self._streams.get(request_id) for request_id in worker.requests)
        return any(stream is not None and not stream.finished for stream in streams)

    def lose(self, worker: SchedulerState, reason: str) -> None:
        """The worker is gone: every stream on it that still expects a delta gets SchedulerLost."""
        for request_id in list(worker.requests):
            stream = self._streams.get(request_id)
            if stream is not None and not stream.finished:  # a finished one has all it will get (or moves on)
                _lose(stream, reason)
        worker.requests.clear()

    def fail_all(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            _lose(stream, reason)


def _lose(stream: RequestStream, reason: str) -> None:
    stream.lost = True
    stream.queue.put_nowait(SchedulerLost(reason))
