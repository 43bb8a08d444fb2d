"""The KV transport interface: how a prompt's pages move from a prefill worker to a decode worker, one
implementation per common.lanes.KVTransport (zmq_frames.py, nixl_protocol.py), each with its two sides.

- The decode side's PullTransport pulls one lease's pages, over the PullLink the puller thread owns (one DEALER
  socket per prefill worker, wire.py's requests and replies).
- The prefill side's ServeTransport answers the wire messages of its protocol on the KV server's ROUTER socket.
  A prefill worker serves the configured transport (kv_transfer_transport) only: NIXL's agent exists only where
  it is the one configured.

The transports share the socket and the lease discipline (KVLeases.begin_read / end_read, each with the lease's
token); they differ in what moves the bytes. Adding one is a module with both sides, a member of KVTransport, and
its lines in the factories.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from common.lanes import KVTransport
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.wire import PULL_CODEC_ENCODER, REPLY_DECODER, PagesReply

# Sends a reply to the reader that asked: the header message, then any raw frames (zero-copy buffers).
Reply = Callable[..., None]


@dataclass(frozen=True, slots=True)
class PullJob:
    request_id: str
    address: str  # the prefill worker's KVTransferParams.remote_address
    lease_id: str
    page_ids: list[int]  # its pages that this worker lacks
    # KVTransferParams.remote_lease_token: the capability the prefill worker minted for this lease. Without it
    # (b"") every pull is refused there.
    token: bytes = b""


class PullLink:
    """The decode side's sockets: one DEALER per prefill worker, one request and its reply at a time. Used by the
    puller thread alone."""

    def __init__(self, context: zmq.Context, timeout_s: float, max_bytes: int):
        self._context = context
        self.timeout_ms = int(timeout_s * 1000)
        self._max_bytes = max_bytes  # the largest reply taken: a whole pool's worth of pages
        self._sockets: dict[str, zmq.Socket] = {}

    def ask(self, address: str, message) -> list:
        """Sends one request and waits for its reply's frames (TimeoutError after the pull timeout)."""
        socket = self._socket(address)
        socket.send(PULL_CODEC_ENCODER.encode(message))
        if not socket.poll(self.timeout_ms):
            # A reply may still come later: a fresh socket makes sure it is never taken for the next request's.
            self._sockets.pop(address).close(linger=0)
            raise TimeoutError(f"no answer from {address} in {self.timeout_ms / 1000:g} s")
        return socket.recv_multipart(copy=False)

    def control(self, address: str, message, expected: type):
        """A request whose reply is one message of type `expected` (LookupError for a refusal in its place)."""
        frames = self.ask(address, message)
        reply = REPLY_DECODER.decode(frames[0].bytes)
        if isinstance(reply, PagesReply) and reply.error and expected is not PagesReply:
            raise LookupError(reply.error)
        if not isinstance(reply, expected):
            raise ValueError(f"reply: a {type(reply).__name__}, expected a {expected.__name__}")
        return reply

    def _socket(self, address: str) -> zmq.Socket:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            socket.connect(address)
            self._sockets[address] = socket
        return socket

    def close(self) -> None:
        for socket in self._sockets.values():
            socket.close(linger=0)


class PullTransport(ABC):
    """The decode side of one transport: made once per puller, used on its thread alone."""

    kind: KVTransport

    @abstractmethod
    def pull(self, link: PullLink, job: PullJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The job's pages' K and V, [layers, pages, page_size, kv_heads, head_dim] each, on the host; raises
        (LookupError for a refusal: an unknown or expired lease, a page it does not hold) on failure."""


class ServeTransport(ABC):
    """The prefill side of one transport, on the KV server's thread: it answers its protocol's messages."""

    kind: KVTransport
    messages: tuple[type, ...]  # the wire requests (wire.ToKVServer members) it answers

    @abstractmethod
    def serve(self, message, reply: Reply) -> str:
        """Answers one of its messages through `reply`; returns the lease whose pages a reader now holds (the
        engine thread releases it), or ""."""

    def progress(self) -> bool:
        """Drives transfers under way (a NIXL read needs this side's progress); True while one is."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Frees what it holds (a NIXL registration) as the server stops."""


def make_pull_transport(kind: KVTransport) -> PullTransport:
    """The decode side of transport `kind` (NIXL's loaded only when asked for: it needs the nixl package)."""
    if kind is KVTransport.ZMQ:
        from gpu_runtime.kv_transfer.zmq_frames import FramesPull

        return FramesPull()
    if kind is KVTransport.NIXL:
        from gpu_runtime.kv_transfer.nixl_protocol import NixlPull

        return NixlPull()
    raise ValueError(f"kv_transfer_transport: {kind!r} has no implementation")


def make_serve_transports(
    pool: KVPool, leases: KVLeases, log, kinds: tuple[KVTransport, ...] = tuple(KVTransport)
) -> list[ServeTransport]:
    """The prefill side of each transport in `kinds` (all of them by default), over this worker's pool."""
    transports: list[ServeTransport] = []
    for kind in kinds:
        if kind is KVTransport.ZMQ:
            from gpu_runtime.kv_transfer.zmq_frames import FramesServe

            transports.append(FramesServe(pool, leases))
        elif kind is KVTransport.NIXL:
            from gpu_runtime.kv_transfer.nixl_protocol import NixlServe

            transports.append(NixlServe(pool, leases, log))
        else:
            raise ValueError(f"kv_transfer_transport: {kind!r} has no implementation")
    return transports
