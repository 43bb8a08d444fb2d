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
from gpu_runtime.kv_transfer.wire import PULL_CODEC_ENCODER, PULL_DECODER, PagesReply, PullPages, tensor_frame

_POLL_MS = 100


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

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        while not self._stopped.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            frames = self._socket.recv_multipart(copy=True)
            if len(frames) != 2:
                self._log.warning("kv_pull_dropped", frames=len(frames))
                continue
            identity, payload = frames
            try:
                pull = PULL_DECODER.decode(payload)
            except Exception as error:  # anything that is not a PullPages (a pickle included) is dropped
                self._log.warning("kv_pull_dropped", bytes=len(payload), error=str(error)[:200])
                continue
            self._answer(identity, pull)
        self._socket.close()

    def _answer(self, identity: bytes, pull: PullPages) -> None:
        refused = self._leases.begin_read(pull.lease_id, pull.page_ids)
        if refused:
            self._socket.send_multipart([identity, PULL_CODEC_ENCODER.encode(PagesReply(error=refused))])
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
        """The pages' K and V of every layer, on the host: [layers, pages, page_size, kv_heads, head_dim] each."""
        device = self._pool.layers[0][0].device
        index = torch.tensor(page_ids, dtype=torch.long, device=device)
        keys = torch.stack([k.index_select(0, index) for k, _ in self._pool.layers]).cpu()
        values = torch.stack([v.index_select(0, index) for _, v in self._pool.layers]).cpu()
        return keys, values
