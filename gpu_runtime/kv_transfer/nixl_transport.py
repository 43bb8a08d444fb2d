"""NIXL (UCX) as the byte mover of a handover: the decode worker READs the leased pages straight out of the
prefill worker's registered KV pool, no copy on the prefill side. NIXL is what vLLM, SGLang and Dynamo use, and
the same calls move GPU memory (and, between boxes, RDMA) where UCX has the transports.

The control stays on the ZeroMQ pull socket (wire.py): the decode worker locks a lease's pages with the lease's
token, which registers those pages (they alone) and answers with their description, READs them, and unlocks them,
which deregisters them. NIXL's agent metadata travels as
the opaque bytes NIXL makes of it; descriptors as plain (address, length, device) integers in msgspec, never
through NIXL's pickling get_serialized_descs. Pages with consecutive ids go as one descriptor per layer, K and V.
"""

from __future__ import annotations

import os
import time
import uuid

import torch

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.wire import PoolDescription

# On one box UCX needs a device it can open; loopback always is. An operator's own settings win.
os.environ.setdefault("UCX_NET_DEVICES", "lo")


def nixl_available() -> bool:
    try:
        import nixl._api  # noqa: F401
    except Exception:  # ImportError, or a wheel that fails to load its libraries
        return False
    return True


def _agent(name: str):
    """An agent without NIXL's progress thread, which spins a core to itself: the reader polls its transfer, and
    the prefill side's KV server drives its own agent while a read is under way."""
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


class NixlPool:
    """The prefill side: an agent that registers a lock's pages, and no others, for the one reader that locked them.
    A reader's NIXL refuses any address outside what the metadata it was given names (and, on RDMA, so does the
    NIC); nothing outside a lease is ever registered."""

    def __init__(self, pool: KVPool):
        self.name = f"tokend-prefill-{uuid.uuid4().hex[:12]}"
        self._agent = _agent(self.name)
        self._layers = pool.layers
        first = pool.layers[0][0]
        self._page_bytes = first[0].numel() * first.element_size()
        self._device_id = max(first.get_device(), 0)
        self._mem_type = _mem_type(first.device)
        self._dtype = str(first.dtype).removeprefix("torch.")
        self._page_shape = list(first.shape[1:])

    def expose(self, page_ids: list[int]) -> tuple[object, PoolDescription]:
        """Registers the pages (K and V of every layer, a region per run of consecutive ids); returns the
        registration (for withdraw) and the description of them alone that their reader needs."""
        regions = [
            (base + first * self._page_bytes, count * self._page_bytes, self._device_id, "")
            for k, v in self._layers
            for base in (k.data_ptr(), v.data_ptr())
            for first, count, _ in _runs(sorted(page_ids))
        ]
        registered = self._agent.register_memory(regions, self._mem_type)
        try:
            metadata = self._agent.get_partial_agent_metadata(registered, True)
        except BaseException:
            self._agent.deregister_memory(registered)
            raise
        description = PoolDescription(
            agent_name=self.name,
            agent_metadata=metadata,
            regions=[(k.data_ptr(), v.data_ptr()) for k, v in self._layers],
            page_bytes=self._page_bytes,
            device_id=self._device_id,
            mem_type=self._mem_type,
            dtype=self._dtype,
            page_shape=self._page_shape,
        )
        return registered, description

    def withdraw(self, registration) -> None:
        self._agent.deregister_memory(registration)

    def progress(self) -> None:
        """Lets UCX move what a reader asked of this side (reading notifications drives its worker)."""
        self._agent.get_new_notifs()


class NixlReader:
    """The decode side: READs pages of described pools into host tensors."""

    def __init__(self):
        self._agent = _agent(f"tokend-decode-{uuid.uuid4().hex[:12]}")

    def read(self, pool: PoolDescription, page_ids: list[int], timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' K and V, [layers, pages, *page_shape] each; raises on failure or after timeout_s. The pool's
        metadata names only these pages, and only for this read: it is forgotten after it."""
        dtype = getattr(torch, pool.dtype)
        shape = [len(pool.regions), len(page_ids), *pool.page_shape]
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        remote_name = self._agent.add_remote_agent(pool.agent_metadata)
        registered = self._agent.register_memory([keys, values])
        handle = None
        try:
            local, remote = _descriptors(pool, page_ids, keys, values)
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, pool.mem_type),
                remote_name,
            )
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"NIXL read of {len(page_ids)} pages not done in {timeout_s:g} s")
                time.sleep(0.0002)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL read of {len(page_ids)} pages failed ({state})")
        finally:
            if handle is not None:
                self._agent.release_xfer_handle(handle)
            self._agent.deregister_memory(registered)
            self._agent.remove_remote_agent(remote_name)
        return keys, values


def _descriptors(pool: PoolDescription, page_ids: list[int], keys: torch.Tensor, values: torch.Tensor):
    """(local, remote) descriptors: one per run of consecutive page ids, per layer, K and V."""
    local, remote = [], []
    for layer, bases in enumerate(pool.regions):
        for target, base in zip((keys, values), bases, strict=True):
            start = target.data_ptr() + layer * len(page_ids) * pool.page_bytes
            for first, count, slot in _runs(page_ids):
                local.append((start + slot * pool.page_bytes, count * pool.page_bytes, 0))
                remote.append((base + first * pool.page_bytes, count * pool.page_bytes, pool.device_id))
    return local, remote


def _runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first page id, how many, slot of the first) for each run of consecutive page ids."""
    runs: list[list[int]] = []
    for slot, page in enumerate(page_ids):
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([page, 1, slot])
    return [tuple(run) for run in runs]
