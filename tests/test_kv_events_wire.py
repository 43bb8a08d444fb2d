"""The box's KV events for routers outside it: the union of the workers' caches, in vLLM's wire format, decoded here
with vLLM's event classes as its source declares them (vllm/distributed/kv_events.py: tagged map events, the batch
a map, block hashes `bytes | int`)."""

from __future__ import annotations

from typing import Any

import msgspec

from frontend.kv_events_publisher import BoxCache, KVEventBatch, external_hash
from gpu_runtime.ipc.messages import KVEvents
from gpu_runtime.kv_cache.kv_events import DEVICE_MEDIUM, HOST_MEDIUM, AllPagesCleared, PagesRemoved, PagesStored

ExternalBlockHash = bytes | int


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VllmBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


A, B, C = (bytes([n]) * 32 for n in (1, 2, 3))


def stored(hashes: list[bytes], parent: bytes | None = None, medium: str = DEVICE_MEDIUM) -> KVEvents:
    tokens = [t for i, _ in enumerate(hashes) for t in range(i * 4, i * 4 + 4)]
    return KVEvents("w", "1", [PagesStored(hashes, parent, tokens, medium)])


def test_vllm_decodes_the_box_s_batches():
    box = BoxCache()
    events = box.changes("llama/0", stored([A, B]), page_size=4)
    events += box.changes("llama/0", KVEvents("w", "1", [PagesRemoved([B], DEVICE_MEDIUM), AllPagesCleared()]), 4)
    payload = msgspec.msgpack.encode(KVEventBatch(12.5, events))
    batch = msgspec.msgpack.decode(payload, type=VllmKVEventBatch)
    first, *removals = batch.events
    assert batch.ts == 12.5 and batch.data_parallel_rank is None
    assert first == VllmBlockStored([external_hash(A), external_hash(B)], None, list(range(8)), 4, None, "GPU", None)
    assert removals == [VllmBlockRemoved([external_hash(B)], "GPU"), VllmBlockRemoved([external_hash(A)], "GPU")]


def test_a_page_two_workers_hold_is_stored_once_and_removed_when_the_last_drops_it():
    box = BoxCache()
    assert len(box.changes("w0", stored([A, B]), 4)) == 1
    # The second worker computes the same prompt and one page more: only the new page is news, parented on B.
    (news,) = box.changes("w1", stored([A, B, C]), 4)
    assert news.block_hashes == [external_hash(C)] and news.parent_block_hash == external_hash(B)
    assert news.token_ids == [8, 9, 10, 11]
    assert box.changes("w0", KVEvents("w0", "1", [PagesRemoved([A, B], DEVICE_MEDIUM)]), 4) == []
    gone = box.changes("w1", None, 4)  # the worker stopped: everything it alone held leaves the box
    assert sorted(h for event in gone for h in event.block_hashes) == sorted(map(external_hash, (A, B, C)))


def test_each_tier_is_its_own_medium_and_a_snapshot_replaces_what_a_worker_held():
    """(The host tier's own copies carry no tokens and go unpublished; a worker storing a page to it with them, as
    here, is published under the CPU medium.)"""
    box = BoxCache()
    box.changes("w0", stored([A, B]), 4)
    (host,) = box.changes("w0", stored([B], medium=HOST_MEDIUM), 4)
    assert host.medium == "CPU" and host.parent_block_hash is None
    changes = box.changes("w0", KVEvents("w0", "2", [PagesStored([C], None, [], DEVICE_MEDIUM)], snapshot=True), 4)
    removed = {(event.medium, h) for event in changes if hasattr(event, "medium") and not hasattr(event, "token_ids")
               for h in event.block_hashes}  # fmt: skip
    assert removed == {("GPU", external_hash(A)), ("GPU", external_hash(B)), ("CPU", external_hash(B))}
    # A snapshot names its pages without their chain or tokens: tracked, not published, until stored with them.
    assert [event for event in changes if hasattr(event, "token_ids")] == []
    (published,) = box.changes("w1", stored([C]), 4)
    assert published.block_hashes == [external_hash(C)] and published.token_ids == [0, 1, 2, 3]
    assert box.changes("w1", None, 4) == []  # w0 still holds C


def test_publishing_beyond_loopback_is_warned_of_at_start():
    """The events carry prompts' token ids, unauthenticated: an endpoint off this machine (the operator's to ask
    for; the defaults are loopback) is said at start, naming it; loopback and ipc:// are not."""
    from frontend.kv_events_publisher import KVEventsPublisher

    class Log:
        def __init__(self):
            self.warnings = []

        def warning(self, event, **fields):
            self.warnings.append((event, fields["endpoints"]))

    quiet, loud = Log(), Log()
    KVEventsPublisher("tcp://127.0.0.1:*", "", "{model}", quiet).close()
    KVEventsPublisher("tcp://0.0.0.0:*", "tcp://127.0.0.1:*", "{model}", loud).close()
    assert quiet.warnings == []
    assert loud.warnings == [("KV_EVENTS_BEYOND_LOOPBACK", ["tcp://0.0.0.0:*"])]
