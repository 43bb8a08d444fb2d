"""The decode side of a handover: a thread that pulls pages from prefill workers while the engine thread keeps
stepping, and hands each result back through the engine thread's inbox (the only way into it)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from gpu_runtime.kv_transfer.wire import (
    PULL_CODEC_ENCODER,
    REPLY_DECODER,
    DescribePool,
    LockPages,
    PagesReply,
    PoolDescription,
    PullPages,
    UnlockPages,
    tensor_of,
)


@dataclass(frozen=True, slots=True)
class PullJob:
    request_id: str
    address: str  # the prefill worker's KVTransferParams.remote_address
    lease_id: str
    page_ids: list[int]  # its pages that this worker lacks


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
    READ). `transport`: "zmq" (the pages come back on the socket) or "nixl" (the socket carries the control)."""

    def __init__(self, context: zmq.Context, inbox: queue.Queue, timeout_s: float, max_bytes: int,
                 transport: str = "zmq"):  # fmt: skip
        super().__init__(name="kv-puller", daemon=True)
        self.transport = transport
        self._reader = None  # the NIXL agent, made on this thread at its first pull
        self._pools: dict[str, PoolDescription] = {}  # prefill worker address -> its NIXL pool
        self._context = context
        self._inbox = inbox
        self._timeout_ms = int(timeout_s * 1000)
        self._max_bytes = max_bytes  # the largest reply taken: a whole pool's worth of pages
        self._jobs: queue.Queue[PullJob | None] = queue.Queue()
        self._sockets: dict[str, zmq.Socket] = {}

    def pull(self, job: PullJob) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            started = time.perf_counter()
            try:
                keys, values = self._fetch(job)
                result = PagesPulled(job.request_id, keys, values, seconds=time.perf_counter() - started)
            except Exception as error:  # every failure is the request's (recompute or fail), never this thread's
                result = PagesPulled(job.request_id, None, None, f"{type(error).__name__}: {error}"[:500],
                                     time.perf_counter() - started)  # fmt: skip
            self._inbox.put(result)
        for socket in self._sockets.values():
            socket.close(linger=0)

    def _fetch(self, job: PullJob) -> tuple[torch.Tensor, torch.Tensor]:
        if self.transport == "nixl":
            return self._read(job)
        frames = self._ask(job.address, PullPages(job.lease_id, job.page_ids))
        reply = REPLY_DECODER.decode(frames[0].bytes)
        if not isinstance(reply, PagesReply):
            raise ValueError(f"reply: a {type(reply).__name__} to a pull")
        if reply.error:
            raise LookupError(reply.error)
        if len(frames) != 3 or reply.shape[1:2] != [len(job.page_ids)]:
            raise ValueError(f"reply: {len(frames)} frames of shape {reply.shape} for {len(job.page_ids)} pages")
        return tensor_of(frames[1].buffer, reply.dtype, reply.shape), tensor_of(frames[2].buffer, reply.dtype,
                                                                                reply.shape)  # fmt: skip

    def _read(self, job: PullJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages by a NIXL READ out of the prefill worker's pool, locked there for the read's length."""
        from gpu_runtime.kv_transfer.nixl_transport import NixlReader

        if self._reader is None:
            self._reader = NixlReader()
        pool = self._pools.get(job.address)
        if pool is None:
            pool = self._pools[job.address] = self._control(job.address, DescribePool(), PoolDescription)
        locked = self._control(job.address, LockPages(job.lease_id, job.page_ids), PagesReply)
        if locked.error:
            if "unknown" in locked.error:  # perhaps a restarted prefill worker: describe it again next time
                self._reader.forget(self._pools.pop(job.address).agent_name)
            raise LookupError(locked.error)
        try:
            return self._reader.read(pool, job.page_ids, self._timeout_ms / 1000)
        finally:
            self._control(job.address, UnlockPages(job.lease_id), PagesReply)

    def _control(self, address: str, message, expected: type):
        frames = self._ask(address, message)
        reply = REPLY_DECODER.decode(frames[0].bytes)
        if isinstance(reply, PagesReply) and reply.error and expected is not PagesReply:
            raise LookupError(reply.error)
        if not isinstance(reply, expected):
            raise ValueError(f"reply: a {type(reply).__name__}, expected a {expected.__name__}")
        return reply

    def _ask(self, address: str, message) -> list:
        """Sends one request and waits for its reply's frames (TimeoutError after the pull timeout)."""
        socket = self._socket(address)
        socket.send(PULL_CODEC_ENCODER.encode(message))
        if not socket.poll(self._timeout_ms):
            # A reply may still come later: a fresh socket makes sure it is never taken for the next request's.
            self._sockets.pop(address).close(linger=0)
            raise TimeoutError(f"no answer from {address} in {self._timeout_ms / 1000:g} s")
        return socket.recv_multipart(copy=False)

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            socket.connect(address)
            self._sockets[address] = socket
        return socket
