"""The box's KV cache events for routers outside it (llm-d's precise prefix-cache scorer, Dynamo's KV router), in
vLLM's wire format, so that they consume a tokend pod as they consume a vLLM one.

A router outside routes to the box, not to one of its workers (the frontend picks those), so what it is told is the
union of the workers' caches: a page is stored when the first worker (or host tier) gets it and removed when the
last one drops it. A worker that stops, restarts or sends a snapshot is diffed against what it held.

The wire, as vLLM's ZmqEventPublisher (vllm/distributed/kv_events.py): a PUB socket sends multipart messages
(topic, sequence number as 8 bytes big-endian, msgpack of a KVEventBatch); a ROUTER socket answers a request for
the batches from a sequence number on (8 bytes big-endian) with each buffered batch (sequence, payload), then the
end marker -1. A batch is {ts, events} with tagged events (`type`: BlockStored, BlockRemoved, AllBlocksCleared);
block hashes are 64-bit integers (the last 8 bytes of tokend's SHA-256 page hashes, as vLLM's int hashes are of
its own), and a stored block's `token_ids` are its tokens, page after page. The token ids are prompt contents:
bind where only routers reach (loopback by default).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

import msgspec
import zmq
import zmq.asyncio

from common.addresses import is_loopback
from gpu_runtime.ipc.messages import KVEvents
from gpu_runtime.kv_cache.kv_events import AllPagesCleared, PagesRemoved, PagesStored

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER = 10_000  # batches kept for a subscriber that missed some (vLLM's buffer_steps)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def external_hash(content_hash: bytes) -> int:
    """A page hash as vLLM's int block hashes are: its last 64 bits."""
    return int.from_bytes(content_hash, "big") & ((1 << 64) - 1)


class BoxCache:
    """The union of the workers' caches, by (hash, medium): which pages the box as a whole gains and loses as each
    worker's events come (the part of the publisher with no sockets).

    A page is published with its tokens and its chain: pages whose tokens the box does not know (a snapshot after a
    hello, a handover's imported pages, the host tier's copies) are tracked but not published until a worker stores
    them with their tokens; a router would file them under a wrong chain, or could not map them at all."""

    def __init__(self) -> None:
        self._held: dict[str, set[tuple[bytes, str]]] = {}  # worker -> (hash, medium) it holds
        self._holders: collections.Counter[tuple[bytes, str]] = collections.Counter()
        self._published: set[tuple[bytes, str]] = set()  # what routers were told the box holds

    def changes(
        self, worker_id: str, message: KVEvents | None, page_size: int = 16
    ) -> list[BlockStored | BlockRemoved]:
        """The box-level events of one worker's message (None: the worker is gone, and its cache with it); its
        pages hold `page_size` tokens each."""
        held = self._held.setdefault(worker_id, set())
        out: list[BlockStored | BlockRemoved] = []
        if message is None or message.snapshot:
            out += self._drop(held, list(held))
        for event in message.events if message is not None else ():
            if isinstance(event, PagesStored):
                out += self._store(held, event, page_size)
            elif isinstance(event, PagesRemoved):
                out += self._drop(held, [(h, event.medium) for h in event.hashes])
            elif isinstance(event, AllPagesCleared):
                out += self._drop(held, list(held))
        if message is None:
            del self._held[worker_id]
        return out

    def _store(self, held: set[tuple[bytes, str]], event: PagesStored, size: int) -> list[BlockStored]:
        """The runs of the event's pages new to what routers know, each with the hash before it as its parent."""
        stored, run, parent = [], [], event.parent
        for i, content_hash in enumerate(event.hashes):
            key = (content_hash, event.medium)
            if key not in held:
                held.add(key)
                self._holders[key] += 1
            if event.token_ids and key not in self._published:
                self._published.add(key)
                run.append(i)
                continue
            stored += self._run(event, run, parent, size)
            run, parent = [], content_hash
        return stored + self._run(event, run, parent, size)

    @staticmethod
    def _run(event: PagesStored, run: list[int], parent: bytes | None, size: int) -> list[BlockStored]:
        if not run:
            return []
        tokens = event.token_ids[run[0] * size : (run[-1] + 1) * size]
        parent_hash = external_hash(parent) if parent is not None else None
        return [BlockStored([external_hash(event.hashes[i]) for i in run], parent_hash, tokens, size, None,
                            event.medium, None)]  # fmt: skip

    def _drop(self, held: set[tuple[bytes, str]], keys: list[tuple[bytes, str]]) -> list[BlockRemoved]:
        gone: dict[str, list[int]] = {}
        for key in keys:
            if key not in held:
                continue
            held.discard(key)
            self._holders[key] -= 1
            if self._holders[key] == 0:
                del self._holders[key]
                if key in self._published:
                    self._published.discard(key)
                    gone.setdefault(key[1], []).append(external_hash(key[0]))
        return [BlockRemoved(hashes, medium) for medium, hashes in gone.items()]


def _tcp_host(endpoint: str) -> str | None:
    """The host of a tcp:// endpoint (brackets kept off an IPv6 one); None for any other transport."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` or connects to it, as vLLM decides (a wildcard or ipc:// binds, a
    router's address is connected to), loopback addresses bound too: tokend's default is to serve them locally.
    A wildcard is bound only because the operator named it in --kv-events-endpoint (the default is loopback), and
    then warned of at start (KV_EVENTS_BEYOND_LOOPBACK)."""
    host = _tcp_host(endpoint)
    return host is None or host in ("*", "::", "0.0.0.0") or is_loopback(host)


def _stays_on_this_machine(endpoint: str) -> bool:
    """ipc://, or TCP on a loopback address."""
    host = _tcp_host(endpoint)
    return host is None or is_loopback(host)


class KVEventsPublisher:
    """The PUB and replay sockets; `publish` is called from the frontend's loop with each worker's events."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str, log):
        self._log = log
        self._context = zmq.asyncio.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.set_hwm(100_000)
            if binds(endpoint):
                self._pub.bind(endpoint)
            else:  # a router's address (llm-d's EPP binds the SUB side): the events go to it
                self._pub.connect(endpoint)
            self._replay = None
            if replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._context.destroy(linger=0)
            raise
        exposed = [e for e in (endpoint, replay_endpoint) if e and not _stays_on_this_machine(e)]
        if exposed:  # the operator asked for it (the defaults are loopback), but the events carry prompts' token ids
            log.warning("KV_EVENTS_BEYOND_LOOPBACK", endpoints=exposed,
                        detail="every published page carries its prompt's token ids, unauthenticated")  # fmt: skip
        self._topic = topic  # "{model}" in it becomes the model's name
        self._box = BoxCache()
        self._encoder = msgspec.msgpack.Encoder()
        self._sequence = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=REPLAY_BUFFER)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        # A new publisher knows nothing yet: what routers kept from an earlier one (this frontend's predecessor) goes.
        self._send([AllBlocksCleared()])
        if self._replay is not None:
            self._task = asyncio.create_task(self._serve_replays(), name="kv-events-replay")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._context.destroy(linger=0)

    def publish(self, model_name: str, worker_id: str, page_size: int, message: KVEvents | None) -> None:
        """One worker's events (None: it is gone), as the box's batch of the changes they make."""
        events = self._box.changes(worker_id, message, page_size)
        if events:
            self._send(events, model_name)

    def _send(self, events: list, model_name: str = "") -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        sequence, self._sequence = self._sequence, self._sequence + 1
        self._buffer.append((sequence, payload))
        topic = self._topic.replace("{model}", model_name).encode()
        with contextlib.suppress(zmq.Again):  # a subscriber that falls behind asks for a replay
            self._pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                self._log.warning("kv_events_replay_refused", frames=len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for sequence, payload in list(self._buffer):
                if sequence >= first:
                    await self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
