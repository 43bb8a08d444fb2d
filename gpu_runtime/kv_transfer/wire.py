"""The pull protocol between a decode worker and a prefill worker, as msgspec on MessagePack plus raw frames.

A pull is one request and one reply on a DEALER/ROUTER pair over ipc:// in the daemon's private directory:

    decode -> prefill   [PullPages]
    prefill -> decode   [PagesReply, keys, values]     keys/values: [layers, pages, page_size, kv_heads, head_dim]

The two tensor frames travel as their raw bytes (zero-copy on the sending side), never pickled; the reply's
header says their dtype and shape, and the receiver checks the byte counts against it.

With NIXL moving the bytes (nixl_transport.py) the same socket carries only the control:

    decode -> prefill   [LockPages]                 -> [PoolDescription]: those pages pinned and registered with
                                                       NIXL (they alone) until UnlockPages; or [PagesReply] refusing
    decode -> prefill   [UnlockPages]               after its READ: -> [PagesReply]; the lease is released

Whatever the transport, a decode worker that needs none of a lease's pages (it has every one cached already, or
they cannot serve it) says so, and the pages are not held for nobody until the lease expires:

    decode -> prefill   [ReleaseLease]              -> [PagesReply]; the lease is released

Every request names its lease and carries the lease's token (leases.py): a request without the right one is
refused, so only the decode worker the frontend handed the request to can read, pin or release the pages.
"""

from __future__ import annotations

import warnings

import msgspec
import torch


class PullPages(msgspec.Struct, frozen=True, tag="pull", forbid_unknown_fields=True):
    lease_id: str  # KVTransferParams.remote_request_id
    page_ids: list[int]  # the pages wanted, each one the lease holds, once (the decode worker's missing ones)
    # KVTransferParams.remote_lease_token. A default so that a request without one still decodes, and is refused
    # by name rather than dropped unanswered.
    token: bytes = b""


class LockPages(msgspec.Struct, frozen=True, tag="lock", forbid_unknown_fields=True):
    lease_id: str
    page_ids: list[int]
    token: bytes = b""


class UnlockPages(msgspec.Struct, frozen=True, tag="unlock", forbid_unknown_fields=True):
    lease_id: str
    token: bytes = b""


class ReleaseLease(msgspec.Struct, frozen=True, tag="release", forbid_unknown_fields=True):
    lease_id: str
    token: bytes = b""


class PagesReply(msgspec.Struct, frozen=True, tag="pages", forbid_unknown_fields=True):
    error: str = ""  # set: no frames follow (an unknown or expired lease, a page it does not hold)
    dtype: str = ""  # "float32", "bfloat16", ...
    shape: list[int] = []  # of each of the two tensor frames


class PoolDescription(msgspec.Struct, frozen=True, tag="pool", forbid_unknown_fields=True):
    """A prefill worker's KV pool, for one lock: what a reader needs to address the locked pages, which alone are
    registered with NIXL (and named in the metadata) while locked."""

    agent_name: str
    agent_metadata: bytes  # NIXL's own serialisation of its agent and those pages (no pickle): add_remote_agent
    regions: list[tuple[int, int]]  # per layer, the base address of its K and of its V tensor
    page_bytes: int  # one page of one layer's K (or V)
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"
    dtype: str
    page_shape: list[int]  # [page_size, kv_heads, head_dim]


TransportRequest = PullPages | LockPages | UnlockPages  # each answered by one transport (transport.py)
ToKVServer = TransportRequest | ReleaseLease  # a release is answered by the KV server itself
FromKVServer = PagesReply | PoolDescription

PULL_CODEC_ENCODER = msgspec.msgpack.Encoder()
PULL_DECODER = msgspec.msgpack.Decoder(ToKVServer)
REPLY_DECODER = msgspec.msgpack.Decoder(FromKVServer)


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (the tensor must be contiguous and on the CPU, and outlive the send)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def tensor_of(frame: bytes | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor a frame carries, read-only and without a copy (it keeps the frame alive); ValueError if its size
    does not match the header's dtype and shape."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype: {dtype!r} is not a torch dtype")
    expected = torch.Size(shape).numel() * torch.empty((), dtype=torch_dtype).element_size()
    if len(frame) != expected:
        raise ValueError(f"frame: {len(frame)} bytes, but {dtype} {shape} takes {expected}")
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(frame, dtype=torch_dtype).view(shape)
