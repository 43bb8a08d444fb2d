"""The pull protocol between a decode worker and a prefill worker, as msgspec on MessagePack plus raw frames.

A pull is one request and one reply on a DEALER/ROUTER pair over ipc:// in the daemon's private directory:

    decode -> prefill   [PullPages]
    prefill -> decode   [PagesReply, keys, values]     keys/values: [layers, pages, page_size, kv_heads, head_dim]

The two tensor frames travel as their raw bytes (zero-copy on the sending side), never pickled; the reply's
header says their dtype and shape, and the receiver checks the byte counts against it.
"""

from __future__ import annotations

import msgspec
import torch


class PullPages(msgspec.Struct, frozen=True, tag="pull", forbid_unknown_fields=True):
    lease_id: str  # KVTransferParams.remote_request_id
    page_ids: list[int]  # the pages wanted, each one the lease holds (the decode worker's missing ones)


class PagesReply(msgspec.Struct, frozen=True, tag="pages", forbid_unknown_fields=True):
    error: str = ""  # set: no frames follow (an unknown or expired lease, a page it does not hold)
    dtype: str = ""  # "float32", "bfloat16", ...
    shape: list[int] = []  # of each of the two tensor frames


PULL_CODEC_ENCODER = msgspec.msgpack.Encoder()
PULL_DECODER = msgspec.msgpack.Decoder(PullPages)
REPLY_DECODER = msgspec.msgpack.Decoder(PagesReply)


def tensor_frame(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy (the tensor must be contiguous and on the CPU, and outlive the send)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def tensor_of(frame: bytes | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor a frame carries; ValueError if its size does not match the header's dtype and shape."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"dtype: {dtype!r} is not a torch dtype")
    expected = torch.Size(shape).numel() * torch.empty((), dtype=torch_dtype).element_size()
    if len(frame) != expected:
        raise ValueError(f"frame: {len(frame)} bytes, but {dtype} {shape} takes {expected}")
    return torch.frombuffer(bytearray(frame), dtype=torch_dtype).view(shape)
