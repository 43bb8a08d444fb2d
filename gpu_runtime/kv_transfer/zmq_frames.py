"""The ZeroMQ-frames KV transport: the prefill side gathers the leased pages to the host and sends them back on the
pull socket as two raw frames (keys, values) after a PagesReply header (wire.py); nothing but ZeroMQ needed."""

from __future__ import annotations

import torch

from common.lanes import KVTransport
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.transport import PullJob, PullLink, PullTransport, Reply, ServeTransport
from gpu_runtime.kv_transfer.wire import REPLY_DECODER, PagesReply, PullPages, tensor_frame, tensor_of


class FramesPull(PullTransport):
    kind = KVTransport.ZMQ

    def pull(self, link: PullLink, job: PullJob) -> tuple[torch.Tensor, torch.Tensor]:
        frames = link.ask(job.address, PullPages(job.lease_id, job.page_ids, job.token))
        reply = REPLY_DECODER.decode(frames[0].bytes)
        if not isinstance(reply, PagesReply):
            raise ValueError(f"reply: a {type(reply).__name__} to a pull")
        if reply.error:
            raise LookupError(reply.error)
        if len(frames) != 3 or reply.shape[1:2] != [len(job.page_ids)]:
            raise ValueError(f"reply: {len(frames)} frames of shape {reply.shape} for {len(job.page_ids)} pages")
        keys = tensor_of(frames[1].buffer, reply.dtype, reply.shape)
        return keys, tensor_of(frames[2].buffer, reply.dtype, reply.shape)


class FramesServe(ServeTransport):
    """Answers PullPages with the pages' K/V, to the holder of the lease's token only. It only reads the pool, and
    only pages the lease pins while it reads."""

    kind = KVTransport.ZMQ
    messages = (PullPages,)

    def __init__(self, pool: KVPool, leases: KVLeases):
        self._pool = pool
        self._leases = leases

    def serve(self, message: PullPages, reply: Reply) -> str:
        refused = self._leases.begin_read(message.lease_id, message.page_ids, message.token)
        if refused:
            reply(PagesReply(error=refused))
            return ""
        try:
            keys, values = self._gather(message.page_ids)
            header = PagesReply(dtype=str(keys.dtype).removeprefix("torch."), shape=list(keys.shape))
            reply(header, tensor_frame(keys), tensor_frame(values))
        finally:
            self._leases.end_read(message.lease_id, message.token)
        return message.lease_id  # answered: the lease has served its purpose

    def close(self) -> None:
        pass  # it holds nothing but the pool, which is the engine's

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
