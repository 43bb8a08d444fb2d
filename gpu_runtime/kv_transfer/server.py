"""The prefill side of a handover: a thread that answers decode workers' pulls with the leased pages' K/V.

It only reads the pool, and only pages a lease pins (the engine thread writes other pages meanwhile; pinned
pages are never handed to another sequence). Once a pull is answered the lease has served its purpose: the
engine thread is told (through its inbox, the only way into it) and releases it.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import zmq

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.wire import (
    PULL_CODEC_ENCODER,
    PULL_DECODER,
    DescribePool,
    LockPages,
    PagesReply,
    PullPages,
    UnlockPages,
    tensor_frame,
)

_POLL_MS = 100
_READING_POLL_MS = 1


@dataclass(frozen=True, slots=True)
class LeasePulled:
    """Put in the engine thread's inbox: a decode worker has the lease's pages; release it. Never on the wire."""

    lease_id: str


class KVServer(threading.Thread):
    def __init__(self, context: zmq.Context, address: str, pool: KVPool, leases: KVLeases, inbox: queue.Queue, log):
        super().__init__(name="kv-server", daemon=True)
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # a pull names pages: far below this
        self._socket.bind(address)
        self._pool = pool
        self._leases = leases
        self._inbox = inbox
        self._log = log
        self._stopped = threading.Event()
        self._nixl = None  # the pool registered with NIXL, on the first reader that asks for it
        self._locked: set[str] = set()  # leases a NIXL reader is reading now: this thread drives UCX meanwhile

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            # NIXL runs without a progress thread (one spins a whole core); a read over UCX's TCP transport needs
            # this side to make progress, so while one is under way this thread polls briskly and drives it.
            if self._locked:
                self._locked = {lease for lease in self._locked if self._leases.is_being_read(lease)}  # dead readers
                self._nixl.progress()
            if not self._socket.poll(_READING_POLL_MS if self._locked else _POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=True)
            if len(frames) != 2:
                self._log.warning("kv_pull_dropped", frames=len(frames))
                continue
            identity, payload = frames
            try:
                pull = PULL_DECODER.decode(payload)
            except Exception as error:  # anything that is not one of the protocol's messages (a pickle too) is dropped
                self._log.warning("kv_pull_dropped", bytes=len(payload), error=str(error)[:200])
                continue
            try:
                self._handle(identity, pull)
            except Exception as error:  # a failure is the asking reader's, never this thread's
                self._log.error("kv_pull_failed", kind=type(pull).__name__, error=str(error)[:300], exc_info=True)
                self._reply(identity, PagesReply(error=f"{type(error).__name__}: {error}"[:500]))
        if self._nixl is not None:
            self._nixl.close()
        self._socket.close()

    def _handle(self, identity: bytes, message) -> None:
        if isinstance(message, PullPages):
            self._answer(identity, message)
        elif isinstance(message, DescribePool):
            if self._nixl is None:
                from gpu_runtime.kv_transfer.nixl_transport import NixlPool

                self._nixl = NixlPool(self._pool)
                self._log.info("kv_nixl_registered", agent=self._nixl.name)
            self._reply(identity, self._nixl.description)
        elif isinstance(message, LockPages):  # a NIXL reader's: the pages stay put until it unlocks them
            refused = self._leases.begin_read(message.lease_id, message.page_ids)
            if not refused and self._nixl is not None:
                self._locked.add(message.lease_id)
            self._reply(identity, PagesReply(error=refused))
        elif isinstance(message, UnlockPages):
            self._locked.discard(message.lease_id)
            self._leases.end_read(message.lease_id)
            self._reply(identity, PagesReply())
            self._inbox.put(LeasePulled(message.lease_id))

    def _reply(self, identity: bytes, message) -> None:
        self._socket.send_multipart([identity, PULL_CODEC_ENCODER.encode(message)])

    def _answer(self, identity: bytes, pull: PullPages) -> None:
        refused = self._leases.begin_read(pull.lease_id, pull.page_ids)
        if refused:
            self._reply(identity, PagesReply(error=refused))
            return
        try:
            keys, values = self._gather(pull.page_ids)
            header = PagesReply(dtype=str(keys.dtype).removeprefix("torch."), shape=list(keys.shape))
            self._socket.send_multipart(
                [identity, PULL_CODEC_ENCODER.encode(header), tensor_frame(keys), tensor_frame(values)], copy=False
            )
        finally:
            self._leases.end_read(pull.lease_id)
        self._inbox.put(LeasePulled(pull.lease_id))

    def _gather(self, page_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' K and V of every layer, on the host: [layers, pages, page_size, kv_heads, head_dim] each,
        gathered straight into the tensors that are sent (one copy)."""
        first = self._pool.layers[0][0]
        index = torch.tensor(page_ids, dtype=torch.long, device=first.device)
        shape = (len(self._pool.layers), len(page_ids), *first.shape[1:])
        keys, values = torch.empty(shape, dtype=first.dtype), torch.empty(shape, dtype=first.dtype)
        for layer, (k, v) in enumerate(self._pool.layers):
            if k.device.type == "cpu":
                torch.index_select(k, 0, index, out=keys[layer])
                torch.index_select(v, 0, index, out=values[layer])
            else:
                keys[layer].copy_(k.index_select(0, index))
                values[layer].copy_(v.index_select(0, index))
        return keys, values
