"""The KV cache's second tier: prefix pages evicted from the device pool are copied to host memory and loaded back
when a prompt needs them again, instead of being dropped and recomputed (vLLM's CPU offloading, SGLang's HiCache).

A page leaves the device pool only when an allocation evicts it (PageAllocator.on_evict): it was free and cached,
its content registered under its hash. HostTier copies it into a host slot at that moment, before anyone can write
the page again, and files the slot under the same hash, so tenant and weight-generation salts hold in this tier as
in the first. A lookup that runs out of device pages goes on in the host tier; the pages it finds are copied into
fresh device pages at admission and registered there, so the prefill that follows reads them like any cached page.
On CUDA both copies run on a copy stream of their own (HostPages), after the kernels that wrote the page and
before the kernels that read or rewrite it, without the host waiting. The host tier has its own LRU, and a slot is
never reused while a copy still reads from it (`hold`).

Under tensor parallelism each rank keeps the host copies of its own heads: rank 0 decides, and its copies go to the
other ranks in order with the step's plan (`take_log`; StepPlan.kv_copies), which they replay before its forward.
The tier is process memory: a restarted worker starts with it empty.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import msgspec
import torch

from gpu_runtime.kv_cache.kv_events import HOST_MEDIUM, KVEventLog
from gpu_runtime.kv_cache.kv_pool import KVPool


class KVCopy(msgspec.Struct, frozen=True, array_like=True):
    """One page copied between the tiers: device page `page` to host slot `slot`, or back."""

    to_host: bool
    page: int
    slot: int


class HostPages:
    """The host tier's bytes: per shared layer tensor of the device pool, a K and a V tensor of `num_slots` pages in
    host memory (pinned on CUDA, so that copies run asynchronously)."""

    def __init__(self, pool: KVPool, num_slots: int):
        self.num_slots = num_slots
        device = pool.layers[0][0].device
        pin = device.type == "cuda"
        self._pairs = [(k, v, _host_like(k, num_slots, pin), _host_like(v, num_slots, pin)) for k, v in _tensors(pool)]
        # On CUDA the copies run on a stream of their own, overlapping the compute stream's work; each waits for
        # the kernels queued before it (that wrote its page), and the next forward waits for them (`before_forward`).
        self._stream = torch.cuda.Stream(device) if pin else None
        self._copies_queued = False

    @staticmethod
    def page_bytes(pool: KVPool) -> int:
        """The bytes of one page of this pool (this rank's heads), K and V of every layer."""
        return sum(k[0].nbytes + v[0].nbytes for k, v in _tensors(pool))

    # One copy per page and tensor, each queued on the current stream on CUDA: a gather on the host side would read
    # pinned memory that an earlier copy to host may not have reached yet.

    def to_host(self, page: int, slot: int) -> None:
        with self._copy_stream():
            for k, v, host_k, host_v in self._pairs:
                host_k[slot].copy_(k[page], non_blocking=True)
                host_v[slot].copy_(v[page], non_blocking=True)
        # The page is handed out to be written next (a forward, or a handover's import): whatever the compute stream
        # queues from now on waits for this copy (on the device: the host goes on).
        self.before_forward()

    def to_device(self, page: int, slot: int) -> None:
        with self._copy_stream():
            for k, v, host_k, host_v in self._pairs:
                k[page].copy_(host_k[slot], non_blocking=True)
                v[page].copy_(host_v[slot], non_blocking=True)

    @contextlib.contextmanager
    def _copy_stream(self) -> Iterator[None]:
        if self._stream is None:  # a CPU pool: plain memcpys, done when the call returns
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield
        self._copies_queued = True

    def before_forward(self) -> None:
        """Makes the compute stream wait for the copies queued since the last call: a page loaded from host is read,
        and a page copied to host is written again, only after its copy."""
        if self._copies_queued:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._copies_queued = False

    def replay(self, copies: list[KVCopy]) -> None:
        """Another rank's copies, in rank 0's order (a page's copy to host before a later load into it)."""
        for copy in copies:
            (self.to_host if copy.to_host else self.to_device)(copy.page, copy.slot)


def _tensors(pool: KVPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The pool's distinct K/V tensor pairs (the layers of KV groups share theirs: kv_groups)."""
    return list({(id(k), id(v)): (k, v) for k, v in pool.layers}.values())


def _host_like(tensor: torch.Tensor, num_slots: int, pin: bool) -> torch.Tensor:
    return torch.zeros((num_slots, *tensor.shape[1:]), dtype=tensor.dtype, pin_memory=pin)


class HostTier:
    """Which content hash sits in which host slot, least recently used first; copies through `pages` (None: the
    bookkeeping alone, for tests of the page pool's states)."""

    def __init__(self, num_slots: int, pages: HostPages | None = None, keep_log: bool = False):
        if num_slots < 1:
            raise ValueError(f"kv_offload_bytes: the host tier needs room for at least one page, got {num_slots}")
        self.num_slots = num_slots
        self.pages = pages
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._hash_of: dict[int, bytes] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._held: set[int] = set()  # slots an admission is about to load from: never reused meanwhile
        self._log: list[KVCopy] | None = [] if keep_log else None
        self.events: KVEventLog | None = None  # what it gains and drops, when the worker reports its cache
        self.num_offloaded = 0  # pages copied to host
        self.num_loaded = 0  # pages copied back to the device
        self.num_dropped = 0  # host pages evicted by newer ones (or offloads with no slot to take)

    def __len__(self) -> int:
        return len(self._slot_of)

    def cached_hashes(self) -> list[bytes]:
        return list(self._slot_of)

    def find(self, content_hash: bytes) -> int | None:
        return self._slot_of.get(content_hash)

    def run_of(self, hashes: list[bytes]) -> list[int]:
        """The slots of the longest leading run of `hashes` held here; changes nothing."""
        slots = []
        for content_hash in hashes:
            slot = self._slot_of.get(content_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def offload(self, page: int, content_hash: bytes) -> None:
        """A cached device page is being evicted: its content is kept here (already kept: only marked recent)."""
        if content_hash in self._slot_of:
            self._slot_of.move_to_end(content_hash)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._slot_of[content_hash] = slot
        self._hash_of[slot] = content_hash
        self._copy(KVCopy(True, page, slot))
        self.num_offloaded += 1
        if self.events is not None:
            self.events.stored(content_hash, None, [], HOST_MEDIUM)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        victim = next((h for h, slot in self._slot_of.items() if slot not in self._held), None)
        if victim is None:
            return None
        slot = self._slot_of.pop(victim)
        del self._hash_of[slot]
        self.num_dropped += 1
        if self.events is not None:
            self.events.removed(victim, HOST_MEDIUM)
        return slot

    def hold(self, slots: list[int]) -> None:
        """Keeps `slots` from reuse until `release` (an admission allocating the pages they go to may evict others,
        whose copies need slots)."""
        self._held.update(slots)

    def release(self, slots: list[int]) -> None:
        """Ends a `hold` (after the load, or an admission that failed before it)."""
        self._held.difference_update(slots)

    def load(self, pages: list[int], slots: list[int]) -> None:
        """Copies held slots into fresh device pages; they stay here too (most recently used)."""
        for slot in slots:
            self._slot_of.move_to_end(self._hash_of[slot])
        if self._log is not None:
            self._log += [KVCopy(False, page, slot) for page, slot in zip(pages, slots, strict=True)]
        if self.pages is not None:
            for page, slot in zip(pages, slots, strict=True):
                self.pages.to_device(page, slot)
        self.num_loaded += len(pages)

    def _copy(self, copy: KVCopy) -> None:
        if self._log is not None:
            self._log.append(copy)
        if self.pages is not None:
            self.pages.to_host(copy.page, copy.slot)

    def take_log(self) -> list[KVCopy]:
        """The copies since the last call, for the other tensor-parallel ranks to replay."""
        log, self._log = self._log or [], [] if self._log is not None else None
        return log

    def check_integrity(self) -> None:
        assert len(self._slot_of) == len(self._hash_of), "host maps disagree in size"
        assert all(self._hash_of[slot] == h for h, slot in self._slot_of.items()), "host maps disagree"
        assert not set(self._free) & set(self._hash_of), "a host slot is free and filled"
        assert len(self._free) + len(self._hash_of) == self.num_slots, "a host slot is lost"
