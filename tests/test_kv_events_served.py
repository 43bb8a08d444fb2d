"""A real daemon's KV events and prefix-aware routing: a subscriber outside the box follows the cache from the
events alone (catching up through the replay socket after it reconnects) and predicts what the daemon then reports
as cached; with two workers, a conversation's next turn goes to the worker holding its pages."""

from __future__ import annotations

import random

import msgspec
import pytest
import zmq
from daemon_harness import Daemon
from harness.local_daemon import free_ports
from test_kv_events_wire import VllmBlockRemoved, VllmBlockStored, VllmKVEventBatch

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from gpu_runtime.kv_cache.page_hashes import PageHasher, model_salt
from tokend.v1 import tokend_pb2 as pb

PAGE = 16
END_OF_REPLAY = -1


def tokens(seed: int, count: int) -> list[int]:
    """`count` token ids of the embedded model's byte-level vocabulary, different for each seed."""
    return random.Random(seed).choices(range(3, 250), k=count)


def _generate(daemon: Daemon, prompt_ids: list[int], max_tokens: int = 2) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(model=TINY_RANDOM_MODEL_NAME, token_ids=pb.TokenIds(ids=prompt_ids),
                                 sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0))  # fmt: skip
    return list(daemon.generation.Generate(request, timeout=60))


class Router:
    """What llm-d's or Dynamo's indexer keeps: the box's pages by medium, from the events alone."""

    def __init__(self) -> None:
        self.pages: set[tuple[str, int]] = set()
        self.last_sequence = -1

    def take(self, sequence: int, payload: bytes) -> None:
        assert sequence == self.last_sequence + 1, (sequence, self.last_sequence)  # nothing missed, nothing twice
        self.last_sequence = sequence
        for event in msgspec.msgpack.decode(payload, type=VllmKVEventBatch).events:
            if isinstance(event, VllmBlockStored):
                self.pages.update((event.medium, h) for h in event.block_hashes)
            elif isinstance(event, VllmBlockRemoved):
                self.pages.difference_update((event.medium, h) for h in event.block_hashes)

    def cached_tokens(self, prompt_ids: list[int], salt: bytes) -> int:
        """The leading pages of a prompt the box holds, hashed as tokend does (its pages' last 64 bits)."""
        count = 0
        for content_hash in PageHasher(PAGE, salt).hash_tokens(prompt_ids[:-1]):
            if ("GPU", int.from_bytes(content_hash[-8:], "big")) not in self.pages:
                break
            count += 1
        return count * PAGE


def _catch_up(context: zmq.Context, replay_address: str, router: Router) -> None:
    """Asks the replay socket for every batch after the router's last, as vLLM's subscribers do (a DEALER, since
    the answer is many messages: each batch, then the end marker)."""
    with context.socket(zmq.DEALER) as replay:
        replay.setsockopt(zmq.LINGER, 0)
        replay.setsockopt(zmq.RCVTIMEO, 30_000)
        replay.connect(replay_address)
        replay.send_multipart((b"", (router.last_sequence + 1).to_bytes(8, "big")))
        while True:
            _, sequence_bytes, payload = replay.recv_multipart()
            sequence = int.from_bytes(sequence_bytes, "big", signed=True)
            if sequence == END_OF_REPLAY:
                return
            router.take(sequence, payload)


def _received(subscriber: zmq.Socket, router: Router) -> int:
    """Takes what the subscription delivered; returns the first sequence it saw after a gap (-1: none)."""
    gap_at = -1
    while subscriber.poll(0):
        _, sequence_bytes, payload = subscriber.recv_multipart()
        sequence = int.from_bytes(sequence_bytes, "big")
        if sequence > router.last_sequence + 1:
            gap_at = sequence if gap_at < 0 else gap_at
            continue  # the replay fills the gap, and brings this one too
        if sequence == router.last_sequence + 1:
            router.take(sequence, payload)
    return gap_at


@pytest.fixture(scope="module")
def daemon():
    events_port, replay_port = free_ports(2)
    with Daemon("--model", TINY_RANDOM_MODEL_NAME, "--enable-kv-cache-events",
                "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}") as running:  # fmt: skip
        running.events_address = f"tcp://127.0.0.1:{events_port}"
        running.replay_address = f"tcp://127.0.0.1:{replay_port}"
        yield running


def test_a_router_follows_the_cache_from_the_events_alone_across_a_reconnect_and_predicts_the_hits(daemon):
    context = zmq.Context()
    router = Router()
    try:
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(daemon.events_address)
        first = tokens(1, 5 * PAGE + 3)
        generation = _generate(daemon, first)[-1].generation
        salt = model_salt(TINY_RANDOM_MODEL_NAME, generation)
        _received(subscriber, router)
        _catch_up(context, daemon.replay_address, router)  # whatever the subscription missed while it joined
        assert router.cached_tokens(first, salt) == 5 * PAGE

        subscriber.close()  # the router goes away; the box goes on caching
        second = tokens(2, 3 * PAGE + 1)
        _generate(daemon, second)
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(daemon.events_address)
        _catch_up(context, daemon.replay_address, router)  # back: the batches it missed, in order, once each
        assert router.cached_tokens(second, salt) == 3 * PAGE

        # Its prediction for a prompt that shares the first one's pages is what the daemon then reports cached.
        third = first[: 4 * PAGE] + tokens(3, 40)
        predicted = router.cached_tokens(third, salt)
        chunks = _generate(daemon, third)
        assert predicted == 4 * PAGE == chunks[-1].usage.cached_tokens
        subscriber.close()
    finally:
        context.destroy(linger=0)


def test_with_two_workers_a_conversation_s_next_turn_goes_where_its_pages_are():
    with Daemon("--model", TINY_RANDOM_MODEL_NAME, "--device", "cpu,cpu") as two:
        workers, conversation = [], tokens(4, 60 * PAGE + 20)
        for turn in range(4):
            history = conversation[: 60 * PAGE + 5 * turn]  # each turn the conversation so far, a bit longer
            chunks = _generate(two, history)
            workers.append(two.log_entries("request_admitted")[-1]["worker"])
            if turn:
                assert chunks[-1].usage.cached_tokens >= 60 * PAGE
        assert len(set(workers)) == 1, workers
