"""NIXL (UCX) as the byte mover of a handover: the decode worker READs the leased pages straight out of the
prefill worker's registered KV pool, no copy on the prefill side. NIXL is what vLLM, SGLang and Dynamo use, and
the same calls move GPU memory (and, between boxes, RDMA) where UCX has the transports.

The control stays on the ZeroMQ pull socket (wire.py): the decode worker asks for the pool's description once per
prefill worker, then locks a lease's pages for the read and unlocks them after. NIXL's agent metadata travels as
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
    """The prefill side: its KV pool registered with NIXL once, and described for readers."""

    def __init__(self, pool: KVPool):
        self.name = f"tokend-prefill-{uuid.uuid4().hex[:12]}"
        self._agent = _agent(self.name)
        tensors = [t for layer in pool.layers for t in layer]
        self._registered = self._agent.register_memory(tensors)
        first = pool.layers[0][0]
        self.description = PoolDescription(
            agent_name=self.name,
            agent_metadata=self._agent.get_agent_metadata(),
            regions=[(k.data_ptr(), v.data_ptr()) for k, v in pool.layers],
            page_bytes=first[0].numel() * first.element_size(),
            device_id=max(first.get_device(), 0),
            mem_type=_mem_type(first.device),
            dtype=str(first.dtype).removeprefix("torch."),
            page_shape=list(first.shape[1:]),
        )

    def progress(self) -> None:
        """Lets UCX move what a reader asked of this side (reading notifications drives its worker)."""
        self._agent.get_new_notifs()

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


class NixlReader:
    """The decode side: READs pages of described pools into host tensors."""

    def __init__(self):
        self._agent = _agent(f"tokend-decode-{uuid.uuid4().hex[:12]}")
        self._remotes: set[str] = set()

    def read(self, pool: PoolDescription, page_ids: list[int], timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages' K and V, [layers, pages, *page_shape] each; raises on failure or after timeout_s."""
        if pool.agent_name not in self._remotes:
            self._agent.add_remote_agent(pool.agent_metadata)
            self._remotes.add(pool.agent_name)
        dtype = getattr(torch, pool.dtype)
        shape = [len(pool.regions), len(page_ids), *pool.page_shape]
        keys, values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        registered = self._agent.register_memory([keys, values])
        handle = None
        try:
            local, remote = [], []
            for layer, bases in enumerate(pool.regions):
                for target, base in zip((keys, values), bases, strict=True):
                    start = target.data_ptr() + layer * len(page_ids) * pool.page_bytes
                    for first, count, slot in _runs(page_ids):
                        local.append((start + slot * pool.page_bytes, count * pool.page_bytes, 0))
                        remote.append((base + first * pool.page_bytes, count * pool.page_bytes, pool.device_id))
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, pool.mem_type),
                pool.agent_name,
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
        return keys, values

    def forget(self, agent_name: str) -> None:
        """A prefill worker restarted (its agent is another now): its old metadata goes."""
        if agent_name in self._remotes:
            self._remotes.discard(agent_name)
            self._agent.remove_remote_agent(agent_name)


def _runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first page id, how many, slot of the first) for each run of consecutive page ids."""
    runs: list[list[int]] = []
    for slot, page in enumerate(page_ids):
        if runs and page == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([page, 1, slot])
    return [tuple(run) for run in runs]
