"""The NIXL KV transport's two sides: the control travels on the pull socket (lock a lease's pages, which registers
them, and them alone, with NIXL and describes them; unlock them after the read; wire.py), the bytes by a NIXL READ
out of the prefill worker's pool (nixl_transport.py, imported at first use: it needs the nixl package)."""

from __future__ import annotations

import torch

from common.lanes import KVTransport
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.transport import PullJob, PullLink, PullTransport, Reply, ServeTransport
from gpu_runtime.kv_transfer.wire import LockPages, PagesReply, PoolDescription, UnlockPages


class NixlPull(PullTransport):
    kind = KVTransport.NIXL

    def __init__(self) -> None:
        self._reader = None  # the NIXL agent, made on the puller's thread at its first pull

    def pull(self, link: PullLink, job: PullJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages by a NIXL READ out of the prefill worker's pool, locked (and exposed) there for the read."""
        from gpu_runtime.kv_transfer.nixl_transport import NixlReader

        if self._reader is None:
            self._reader = NixlReader()
        pool = link.control(job.address, LockPages(job.lease_id, job.page_ids, job.token), PoolDescription)
        try:
            return self._reader.read(pool, job.page_ids, link.timeout_ms / 1000)
        finally:
            link.control(job.address, UnlockPages(job.lease_id, job.token), PagesReply)


class NixlServe(ServeTransport):
    """Between a reader's LockPages and UnlockPages (both with the lease's token) pins the pages it asked for and
    registers them with NIXL, they alone; drives UCX while any are being read. Nothing is registered, and no agent
    exists, before the first valid lock: a peer without a lease learns nothing of the pool."""

    kind = KVTransport.NIXL
    messages = (LockPages, UnlockPages)

    def __init__(self, pool: KVPool, leases: KVLeases, log):
        self._pool = pool
        self._leases = leases
        self._log = log
        self._nixl = None  # the NIXL agent, made at the first valid lock
        self._exposed: dict[str, object] = {}  # lease being read now -> its pages' NIXL registration

    def serve(self, message, reply: Reply) -> str:
        if isinstance(message, LockPages):  # the pages stay put (and readable) until the reader unlocks them
            refused = self._leases.begin_read(message.lease_id, message.page_ids, message.token)
            if refused:
                reply(PagesReply(error=refused))
                return ""
            try:
                if self._nixl is None:
                    from gpu_runtime.kv_transfer.nixl_transport import NixlPool

                    self._nixl = NixlPool(self._pool)
                    self._log.info("kv_nixl_started", agent=self._nixl.name)
                registration, description = self._nixl.expose(message.page_ids)
            except BaseException:
                self._leases.end_read(message.lease_id, message.token)
                raise
            self._exposed[message.lease_id] = registration
            reply(description)
            return ""
        refused = self._leases.end_read(message.lease_id, message.token)  # UnlockPages: the reader has its pages
        if refused:
            reply(PagesReply(error=refused))
            return ""
        self._withdraw(message.lease_id)
        reply(PagesReply())
        return message.lease_id

    def progress(self) -> bool:
        # NIXL runs without a progress thread (one spins a whole core); a read over UCX's TCP transport needs this
        # side to make progress, so while one is under way the server polls briskly and drives it here.
        for lease in [lease for lease in self._exposed if not self._leases.is_being_read(lease)]:
            self._withdraw(lease)  # its reader died (or outlived READ_LIMIT_S): its pages are no longer readable
        if self._exposed:
            self._nixl.progress()
        return bool(self._exposed)

    def _withdraw(self, lease_id: str) -> None:
        registration = self._exposed.pop(lease_id, None)
        if registration is not None:
            self._nixl.withdraw(registration)

    def close(self) -> None:
        for lease in list(self._exposed):
            self._withdraw(lease)
