"""The decode side of a handover: a thread that pulls pages from prefill workers while the engine thread keeps
stepping, and hands each result back through the engine thread's inbox (the only way into it). How the pages
come over is its transport's (transport.py): ZeroMQ frames or a NIXL READ, chosen once per worker."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from common.lanes import KVTransport
from gpu_runtime.kv_transfer.transport import PullJob, PullLink, make_pull_transport
from gpu_runtime.kv_transfer.wire import PagesReply, ReleaseLease

__all__ = ["KVPuller", "LeaseRelease", "PagesPulled", "PullJob"]


@dataclass(frozen=True, slots=True)
class LeaseRelease:
    """A lease this worker takes no page of (it has them all cached): its prefill worker may free them now."""

    address: str  # the prefill worker's KVTransferParams.remote_address
    lease_id: str
    token: bytes


@dataclass(frozen=True, slots=True)
class PagesPulled:
    """A pull's outcome, put in the engine thread's inbox. Never on the wire."""

    request_id: str
    keys: torch.Tensor | None  # [layers, pages, page_size, kv_heads, head_dim]; None when it failed
    values: torch.Tensor | None
    error: str = ""
    seconds: float = 0.0

    @property
    def num_bytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return self.keys.numel() * self.keys.element_size() * 2


class KVPuller(threading.Thread):
    """One DEALER socket per prefill worker, one pull at a time (each pull is a few large frames, or one NIXL
    READ). `transport`: a common.lanes.KVTransport (or its value, "zmq" or "nixl")."""

    def __init__(self, context: zmq.Context, inbox: queue.Queue, timeout_s: float, max_bytes: int,
                 transport: KVTransport | str = KVTransport.ZMQ):  # fmt: skip
        super().__init__(name="kv-puller", daemon=True)
        self.transport = KVTransport(transport)  # ValueError for a name that is none of its members
        self._pulls = make_pull_transport(self.transport)
        self._link = PullLink(context, timeout_s, max_bytes)
        self._inbox = inbox
        self._jobs: queue.Queue[PullJob | LeaseRelease | None] = queue.Queue()

    def pull(self, job: PullJob) -> None:
        self._jobs.put(job)

    def release(self, job: LeaseRelease) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, LeaseRelease):
                self._release(job)
                continue
            started = time.perf_counter()
            try:
                keys, values = self._pulls.pull(self._link, job)
                result = PagesPulled(job.request_id, keys, values, seconds=time.perf_counter() - started)
            except Exception as error:  # every failure is the request's (recompute or fail), never this thread's
                result = PagesPulled(job.request_id, None, None, f"{type(error).__name__}: {error}"[:500],
                                     time.perf_counter() - started)  # fmt: skip
            self._inbox.put(result)
        self._link.close()

    def _release(self, job: LeaseRelease) -> None:
        """Tells the prefill worker. Its answer changes nothing here: whatever fails, the lease expires there."""
        with contextlib.suppress(Exception):  # no answer, a refusal, a bad reply: all end the same way
            self._link.control(job.address, ReleaseLease(job.lease_id, job.token), PagesReply)
