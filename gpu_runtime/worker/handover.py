"""Disaggregated serving inside one scheduler process: the prefill side's leases and KV server, the decode side's
pulls. The scheduler loop calls it at its step boundaries; everything here that touches the engine runs on the
engine thread, the socket work on the server and puller threads.

A prefill worker runs a `do_remote_decode` request (its frontend asked for one token), and when that first token
ends it by max_tokens, pins the prompt's full pages under a lease and hands the request over: its final delta says
`handover`, with the KVTransferParams of those pages. A decode worker
given `kv_transfer_params` pulls the pages it lacks (by hash) while it keeps stepping, imports them into its
prefix cache, and only then admits the request, which finds its prompt cached except the last partial page.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from common.lanes import KVLoadFailure, KVTransport
from gpu_runtime.engine import LLMEngine
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import AddRequest, KVTransferParams, RequestDelta
from gpu_runtime.kv_cache.transfer import PageExport, import_pages
from gpu_runtime.kv_transfer.puller import KVPuller, LeaseRelease, PagesPulled, PullJob
from gpu_runtime.kv_transfer.server import KVServer, LeasePulled

_THREAD_STOP_S = 1.0  # a KV thread notices a stop within one poll (0.1 s); one mid-pull is left to die with us


@dataclass(slots=True)
class HandoverStats:
    pulled_pages: int = 0
    pulled_bytes: int = 0
    pull_seconds: float = 0.0
    pull_failures: int = 0


@dataclass(slots=True)
class _PendingPull:
    message: AddRequest
    hashes: list[bytes]
    positions: list[int]  # the chain positions pulled (the others were cached here)
    started: float = field(default_factory=time.monotonic)


class Handover:
    def __init__(
        self,
        engine: LLMEngine,
        context: zmq.Context,
        inbox: queue.Queue,
        log,
        *,
        worker_id: str,
        kv_address: str,
        lease_seconds: float,
        load_failure: KVLoadFailure,
        transport: KVTransport = KVTransport.ZMQ,
    ):
        self._transport = transport  # how pages are pulled here
        self.engine = engine
        self._context = context
        self._inbox = inbox
        self._log = log
        self._worker_id = worker_id
        self._kv_address = kv_address
        self._load_failure = load_failure
        self._lease_seconds = lease_seconds
        self.leases = engine.leases
        self.stats = HandoverStats()
        self._prefills: dict[str, AddRequest] = {}  # do_remote_decode requests running here
        self._pulls: dict[str, _PendingPull] = {}  # requests waiting for their pages
        self._server: KVServer | None = None
        self._puller: KVPuller | None = None

    def start_server(self) -> None:
        """Prefill workers serve pulls (on the private ipc:// address the daemon gave them)."""
        # Only the configured transport: NIXL's agent and registrations exist only where NIXL is configured.
        self._server = KVServer(self._context, self._kv_address, self.engine.runner.pool, self.leases, self._inbox,
                                self._log, transports=(self._transport,))  # fmt: skip
        self._server.start()

    def close(self) -> None:
        """Stops the KV threads and waits for them: they close their own sockets, which must happen before the
        worker destroys the ZeroMQ context (a socket closed under a thread's poll raises in that thread)."""
        threads = [thread for thread in (self._server, self._puller) if thread is not None]
        for thread in threads:
            thread.stop()
        for thread in threads:
            thread.join(timeout=_THREAD_STOP_S)

    @property
    def has_pending(self) -> bool:
        return bool(self._pulls)

    def pending_ids(self) -> list[str]:
        return list(self._pulls)

    # -- requests in ------------------------------------------------------------------------------------------

    def add(self, message: AddRequest, admit: Callable[[AddRequest], list[RequestDelta]]) -> list[RequestDelta]:
        """Admits the request now, or once its pages are pulled. A lease it takes no page of is released at once:
        its prefill worker would otherwise hold those pages for nobody until the lease expired."""
        if message.do_remote_decode:
            self._prefills[message.request_id] = message
        params = message.kv_transfer_params
        if params is None or not params.remote_block_ids:
            return admit(message)
        hashes, missing = self._missing_pages(message, params)
        if not missing:
            self._kv_puller().release(LeaseRelease(params.remote_address, params.remote_request_id,
                                                   params.remote_lease_token))  # fmt: skip
            return admit(message)
        self._pulls[message.request_id] = _PendingPull(message, hashes, missing)
        page_ids = [params.remote_block_ids[i] for i in missing]
        self._kv_puller().pull(PullJob(message.request_id, params.remote_address, params.remote_request_id,
                                       page_ids, params.remote_lease_token))  # fmt: skip
        return []

    def _missing_pages(self, message: AddRequest, params: KVTransferParams) -> tuple[list[bytes], list[int]]:
        """The prompt's page hashes here, and the positions of the leased pages to pull: those not cached here
        already; none when the leased pages cannot serve here (no prefix cache to put them in, or other contents, or
        a pool in KV groups, whose pages hold one group's layers each: a mixed worker of a hybrid model)."""
        if not self.engine.config.enable_prefix_caching or self.engine.kv.num_groups > 1:
            return [], []
        own = self.engine.kv.hasher.hash_tokens(message.prompt_token_ids[: params.remote_num_tokens],
                                                message.cache_salt)  # fmt: skip
        if own != params.remote_page_hashes or len(params.remote_block_ids) != len(own):
            # Other weights (a rollout between the two hops) or another tokenisation: its pages would be wrong here.
            self._log.warning("kv_transfer_mismatch", request_id=message.request_id, remote=params.remote_engine_id)
            return own, []
        allocator = self.engine.kv.allocator
        return own, [i for i, content_hash in enumerate(own) if allocator.lookup(content_hash) is None]

    def _kv_puller(self) -> KVPuller:
        if self._puller is None:
            pool_bytes = 2 * sum(k.numel() * k.element_size() for k, _ in self.engine.runner.pool.layers)
            self._puller = KVPuller(self._context, self._inbox, self._lease_seconds, pool_bytes + (1 << 20),
                                    self._transport)  # fmt: skip
            self._puller.start()
        return self._puller

    def pulled(self, result: PagesPulled, admit: Callable[[AddRequest], list[RequestDelta]]) -> list[RequestDelta]:
        """A pull ended: its pages go into the prefix cache and the request is admitted (or, if the pull or the
        import failed, recomputed or failed as kv_load_failure says). Nothing that fails from here escapes: the
        request has left the pending pulls, so an escaped failure would leave it with no final delta."""
        pending = self._pulls.pop(result.request_id, None)
        if pending is None:
            return []  # aborted while its pages travelled
        message = pending.message
        error = result.error or self._import(pending, result)
        if error:
            self.stats.pull_failures += 1
            self._log.warning("kv_pull_failed", request_id=message.request_id, error=error,
                              action=self._load_failure)  # fmt: skip
            if self._load_failure == KVLoadFailure.FAIL:
                num_prompt = len(message.prompt_token_ids)
                reason = f"the prompt's KV pages could not be moved to the decode worker ({error}); retry"
                return [RequestDelta(message.request_id, [], None, FinishReason.ERROR, num_prompt, 0, 0, reason,
                                     retryable=True)]  # fmt: skip
            return self._admit(message, admit)
        self.stats.pulled_pages += len(pending.positions)
        self.stats.pulled_bytes += result.num_bytes
        self.stats.pull_seconds += result.seconds
        self._log.debug("kv_pulled", request_id=message.request_id, pages=len(pending.positions),
                        bytes=result.num_bytes, seconds=round(result.seconds, 4))  # fmt: skip
        return self._admit(message, admit)

    def _import(self, pending: _PendingPull, result: PagesPulled) -> str:
        """Writes a pull's pages into the prefix cache: "" once they are in, else why not. The tensors are checked
        against this pool first, so a malformed pull is refused before import_pages takes any page."""
        try:
            _check_shape(result, len(pending.positions), self.engine.runner.pool.layers)
            export = PageExport(self.engine.kv.page_size, pending.hashes, result.keys, result.values, pending.positions)
            import_pages(self.engine.kv, self.engine.runner.pool, export)
        except ValueError as refused:  # not enough free pages here right now, or not pages of this pool
            return f"import: {refused}"
        except Exception as error:  # a failing device or a bug: the request's failure, never the loop's
            self._log.error("kv_import_failed", request_id=pending.message.request_id, error_type=type(error).__name__,
                            exc_info=True)  # fmt: skip
            return f"import: {type(error).__name__}: {error}"[:500]
        return ""

    def _admit(self, message: AddRequest, admit: Callable[[AddRequest], list[RequestDelta]]) -> list[RequestDelta]:
        """admit(message), except that a failure ends the request with an error delta (the scheduler loop's backstop
        does that only for requests that come as an AddRequest; this one comes as a PagesPulled)."""
        try:
            return admit(message)
        except Exception as error:
            kind = type(error).__name__
            self._log.error("kv_admit_failed", request_id=message.request_id, error_type=kind, error=str(error)[:200],
                            exc_info=True)  # fmt: skip
            if message.request_id in self.engine.unfinished_request_ids():
                return []  # the engine took it after all: its own final delta will come
            num_prompt = len(message.prompt_token_ids)
            reason = f"the scheduler failed on this request ({kind})"
            return [RequestDelta(message.request_id, [], None, FinishReason.ERROR, num_prompt, 0, 0, reason)]

    def abort(self, request_id: str) -> RequestDelta | None:
        """Ends a request still waiting for its pages (its final delta), or releases a lease of that id (the
        frontend gave up on the decode hop); None if neither. An aborted prefill will never ask for a lease: its
        entry goes here too, since orphans' final deltas never pass through finished()."""
        self.leases.release(request_id)
        self._prefills.pop(request_id, None)
        pending = self._pulls.pop(request_id, None)
        if pending is None:
            return None
        num_prompt = len(pending.message.prompt_token_ids)
        return RequestDelta(request_id, [], None, FinishReason.ABORT, num_prompt, 0, 0)

    # -- after a step -----------------------------------------------------------------------------------------

    def finished(self, deltas: list[RequestDelta]) -> list[RequestDelta]:
        """Hands over each prefill whose first token did not end it for good: the frontend sent it with max_tokens
        1, so a LENGTH finish is that cut, and its final delta says `handover` (a stop token or an abort ends the
        request here, and says nothing of the kind)."""
        if not self._prefills:
            return deltas
        out = []
        for delta in deltas:
            message = self._prefills.get(delta.request_id) if delta.finished else None
            if message is not None:
                del self._prefills[delta.request_id]
                if delta.finish_reason is FinishReason.LENGTH:
                    delta = self._hand_over(message, delta)
            out.append(delta)
        return out

    def _hand_over(self, message: AddRequest, delta: RequestDelta) -> RequestDelta:
        # No page leased (the prompt filled none, or caching is off) is still a handover: the decode worker
        # computes the whole prompt.
        page_ids, hashes = self.leases.grant(message.request_id, message.prompt_token_ids, message.cache_salt,
                                             self._lease_seconds)  # fmt: skip
        params = KVTransferParams(
            remote_engine_id=self._worker_id,
            remote_request_id=message.request_id,
            remote_address=self._kv_address,
            remote_block_ids=page_ids,
            remote_page_hashes=hashes,
            remote_num_tokens=len(page_ids) * self.engine.kv.page_size,
            remote_lease_token=self.leases.token_of(message.request_id),
        )
        return msgspec.structs.replace(delta, handover=params)

    def lease_pulled(self, message: LeasePulled) -> None:
        self.leases.release(message.lease_id)

    def expire(self) -> None:
        expired = self.leases.expire()
        if expired:
            self._log.warning("kv_leases_expired", count=len(expired), detail="no decode worker pulled them")


def _check_shape(result: PagesPulled, num_pages: int, layers: list) -> None:
    """ValueError unless the pull holds `num_pages` pages of K and of V for every layer of this pool."""
    key_cache, _ = layers[0]
    expected = (len(layers), num_pages, *key_cache.shape[1:])
    for name, tensor in (("keys", result.keys), ("values", result.values)):
        shape = None if tensor is None else tuple(tensor.shape)
        if shape != expected:
            raise ValueError(f"pulled {name}: shape {shape}, this pool takes {expected}")
