"""The prefill side of a handover: a thread that answers decode workers' pulls on one ROUTER socket, each request
by the transport whose protocol it belongs to (transport.py: ZeroMQ frames and NIXL, served side by side).

It only reads the pool, and only pages a lease pins (the engine thread writes other pages meanwhile; pinned
pages are never handed to another sequence). Once a reader has a lease's pages the lease has served its purpose:
the engine thread is told (through its inbox, the only way into it) and releases it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import zmq

from common.lanes import KVTransport
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.transport import ServeTransport, make_serve_transports
from gpu_runtime.kv_transfer.wire import PULL_CODEC_ENCODER, PULL_DECODER, PagesReply, ReleaseLease

_POLL_MS = 100
_READING_POLL_MS = 1


@dataclass(frozen=True, slots=True)
class LeasePulled:
    """Put in the engine thread's inbox: a decode worker has the lease's pages; release it. Never on the wire."""

    lease_id: str


class KVServer(threading.Thread):
    """Serves `transports`: the worker's configured one (kv_transfer_transport), so that NIXL's agent and
    registrations exist only where NIXL is configured. Every refusal (a wrong token, a page outside the lease) is
    logged as kv_pull_refused, with the lease id but never the token."""

    def __init__(self, context: zmq.Context, address: str, pool: KVPool, leases: KVLeases, inbox: queue.Queue, log,
                 transports: tuple[KVTransport, ...] = (KVTransport.ZMQ,)):  # fmt: skip
        super().__init__(name="kv-server", daemon=True)
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a pull names pages: far below this
        self._socket.bind(address)
        self._inbox = inbox
        self._leases = leases
        self._log = log
        self._stopped = threading.Event()
        self._transports = make_serve_transports(pool, leases, log, transports)
        self._by_message: dict[type, ServeTransport] = {
            message: transport for transport in self._transports for message in transport.messages
        }

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            busy = [transport.progress() for transport in self._transports]  # every one driven, not the first only
            if not self._socket.poll(_READING_POLL_MS if any(busy) else _POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=True)
            if len(frames) != 2:
                self._log.warning("kv_pull_dropped", frames=len(frames))
                continue
            identity, payload = frames
            try:
                request = PULL_DECODER.decode(payload)
            except Exception as error:  # anything that is not one of the protocol's messages (a pickle too) is dropped
                self._log.warning("kv_pull_dropped", bytes=len(payload), error=str(error)[:200])
                continue
            try:
                self._handle(identity, request)
            except Exception as error:  # a failure is the asking reader's, never this thread's
                self._log.error("kv_pull_failed", kind=type(request).__name__, error=str(error)[:300], exc_info=True)
                self._reply(identity, PagesReply(error=f"{type(error).__name__}: {error}"[:500]))
        for transport in self._transports:
            transport.close()
        self._socket.close()

    def _handle(self, identity: bytes, request) -> None:
        def reply(header, *frames) -> None:
            if isinstance(header, PagesReply) and header.error:  # refused: the lease is as it was
                self._log.warning("kv_pull_refused", kind=type(request).__name__, lease_id=request.lease_id,
                                  error=header.error[:300])  # fmt: skip
            self._reply(identity, header, *frames)

        if isinstance(request, ReleaseLease):  # the reader needs none of its pages: the lease is done with
            refused = self._leases.check(request.lease_id, request.token)
            reply(PagesReply(error=refused))
            if not refused:
                self._inbox.put(LeasePulled(request.lease_id))
            return
        transport = self._by_message.get(type(request))
        if transport is None:
            served = ", ".join(str(t.kind) for t in self._transports)
            reply(PagesReply(error=f"a {type(request).__name__} of lease {request.lease_id!r} is not served here "
                                   f"({served} is)"))  # fmt: skip
            return
        lease_id = transport.serve(request, reply)
        if lease_id:
            self._inbox.put(LeasePulled(lease_id))

    def _reply(self, identity: bytes, header, *frames) -> None:
        # The frames are raw buffers, sent without a copy (they outlive the send: zmq holds them until it is done).
        self._socket.send_multipart([identity, PULL_CODEC_ENCODER.encode(header), *frames], copy=not frames)
