"""A handover's byte movers, each against a real KV server thread over ipc://: ZeroMQ frames always, NIXL (UCX,
host memory over loopback) where it imports. The pulled pages equal the pool's, pages not leased are refused,
an expired lease is named, and a lease is a capability: without its token nothing is read, pinned or released."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import structlog
import torch
import zmq

from common.lanes import KVTransport
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.nixl_transport import _runs, nixl_available
from gpu_runtime.kv_transfer.puller import KVPuller, LeaseRelease, PagesPulled, PullJob
from gpu_runtime.kv_transfer.server import KVServer, LeasePulled
from gpu_runtime.kv_transfer.wire import (
    PULL_CODEC_ENCODER,
    REPLY_DECODER,
    LockPages,
    PagesReply,
    PoolDescription,
    PullPages,
    ReleaseLease,
    UnlockPages,
)
from gpu_runtime.sequence import Sequence

TRANSPORTS = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed"))]
LAYERS, PAGES, PAGE_SIZE, HEADS, DIM = 3, 16, 4, 2, 8


@pytest.fixture
def prefill_side(tmp_path):
    """A pool of random K/V, a lease on a computed prompt's four full pages, and the KV server serving it."""
    torch.manual_seed(0)
    shape = (PAGES, PAGE_SIZE, HEADS, DIM)
    pool = SimpleNamespace(layers=[(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)])
    kv = KVCacheManager(PAGES, PAGE_SIZE)
    prompt = list(range(1, 4 * PAGE_SIZE + 2))
    seq = Sequence("lease", prompt, SamplingParams(max_tokens=1), max_model_len=64, eos_token_ids=frozenset())
    kv.hash_new_pages(seq)
    assert kv.try_admit(seq, kv.find_cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.commit_full_pages(seq)
    kv.release(seq)
    leases = KVLeases(kv)
    pages, _ = leases.grant("lease", prompt, "", seconds=60)
    context, inbox = zmq.Context(), queue.Queue()
    address = f"ipc://{tmp_path}/kv.ipc"
    log = structlog.get_logger()
    server = KVServer(context, address, pool, leases, inbox, log, transports=tuple(KVTransport))
    server.start()
    outside = next(page for page in range(PAGES) if page not in pages)
    yield SimpleNamespace(pool=pool, address=address, inbox=inbox, pages=pages, outside=outside, context=context,
                          leases=leases, token=leases.token_of("lease"), server=server)  # fmt: skip
    server.stop()
    server.join(timeout=5)
    context.destroy(linger=0)


def _pull(side, transport: str, lease: str, pages: list[int], token: bytes | None = None) -> PagesPulled:
    inbox = queue.Queue()
    puller = KVPuller(side.context, inbox, timeout_s=20, max_bytes=1 << 26, transport=transport)
    puller.start()
    puller.pull(PullJob("r", side.address, lease, pages, side.token if token is None else token))
    result = inbox.get(timeout=30)
    puller.stop()
    puller.join(timeout=10)
    return result


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pulled_pages_equal_the_prefill_pool_and_the_lease_is_released(prefill_side, transport):
    wanted = [prefill_side.pages[3], prefill_side.pages[0], prefill_side.pages[1]]  # out of order, and a run
    result = _pull(prefill_side, transport, "lease", wanted)
    assert result.error == ""
    for layer, (k, v) in enumerate(prefill_side.pool.layers):
        assert torch.equal(result.keys[layer], k[wanted]) and torch.equal(result.values[layer], v[wanted])
    assert result.num_bytes == 2 * LAYERS * len(wanted) * PAGE_SIZE * HEADS * DIM * 4
    assert prefill_side.inbox.get(timeout=5) == LeasePulled("lease")  # the engine thread releases it


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pages_outside_the_lease_and_unknown_leases_are_refused(prefill_side, transport):
    outside = prefill_side.outside
    refused = _pull(prefill_side, transport, "lease", [prefill_side.pages[0], outside]).error
    assert f"page {outside} is not held by lease 'lease'" in refused
    assert "lease 'gone' is unknown here" in _pull(prefill_side, transport, "gone", prefill_side.pages[:1]).error
    assert prefill_side.inbox.empty()  # nothing was pulled: nothing to release


def _ask(side, message) -> tuple[object, int]:
    """One raw request on the KV socket, as any local process could send it: (the reply's header, its frames)."""
    dealer = side.context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(side.address)
    try:
        dealer.send(PULL_CODEC_ENCODER.encode(message))
        assert dealer.poll(20_000), "the KV server did not answer"
        frames = dealer.recv_multipart()
        return REPLY_DECODER.decode(frames[0]), len(frames)
    finally:
        dealer.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_with_the_lease_id_but_not_its_token_is_refused_and_the_genuine_one_completes(prefill_side, transport):
    pages, token = prefill_side.pages, prefill_side.token
    for wrong in (b"", bytes(32), token[:-1] + bytes([token[-1] ^ 1])):
        assert "refused: its token is missing or wrong" in _pull(prefill_side, transport, "lease", pages, wrong).error
        assert not prefill_side.leases.is_being_read("lease") and len(prefill_side.leases) == 1
    assert prefill_side.inbox.empty()  # nothing released
    result = _pull(prefill_side, transport, "lease", pages)
    assert result.error == "" and torch.equal(result.keys[0], prefill_side.pool.layers[0][0][pages])
    assert prefill_side.inbox.get(timeout=5) == LeasePulled("lease")


def test_forged_pulls_locks_and_unlocks_get_no_bytes_and_leave_the_lease_untouched(prefill_side):
    pages = prefill_side.pages
    for message in (PullPages("lease", pages), LockPages("lease", pages), LockPages("lease", pages, bytes(32)),
                    UnlockPages("lease"), UnlockPages("lease", b"guess")):  # fmt: skip
        reply, frames = _ask(prefill_side, message)
        assert isinstance(reply, PagesReply) and "token is missing or wrong" in reply.error and frames == 1
    assert not prefill_side.leases.is_being_read("lease") and len(prefill_side.leases) == 1
    assert prefill_side.inbox.empty()  # no forged unlock released it


def test_a_reader_that_needs_no_page_releases_the_lease_with_its_token_only(prefill_side):
    """A decode worker with the prompt cached already takes no page: its release frees the lease at once rather
    than at its expiry; a release without the lease's token is refused and frees nothing."""
    for forged in (ReleaseLease("lease"), ReleaseLease("lease", b"guess")):
        reply, frames = _ask(prefill_side, forged)
        assert "token is missing or wrong" in reply.error and frames == 1
    assert prefill_side.inbox.empty()
    puller = KVPuller(prefill_side.context, queue.Queue(), timeout_s=20, max_bytes=1 << 20)
    puller.start()
    puller.release(LeaseRelease(prefill_side.address, "lease", prefill_side.token))
    assert prefill_side.inbox.get(timeout=30) == LeasePulled("lease")  # the engine thread releases it
    puller.stop()
    puller.join(timeout=10)


def test_duplicate_page_ids_are_refused_without_a_byte_of_pages(prefill_side):
    """The 20 KB pull of one page id repeated that returned 313 MiB: refused, in a reply of one small frame."""
    token, page = prefill_side.token, prefill_side.pages[0]
    reply, frames = _ask(prefill_side, PullPages("lease", [page] * 5000, token))
    assert "names a page more than once" in reply.error and frames == 1
    reply, frames = _ask(prefill_side, LockPages("lease", [page, page], token))
    assert "names a page more than once" in reply.error and frames == 1
    assert not prefill_side.leases.is_being_read("lease")
    pulled = _pull(prefill_side, "zmq", "lease", prefill_side.pages)
    assert pulled.num_bytes == 2 * LAYERS * len(prefill_side.pages) * PAGE_SIZE * HEADS * DIM * 4  # the lease's own


@pytest.mark.skipif(not nixl_available(), reason="nixl not installed")
def test_the_nixl_pool_is_described_only_to_a_lease_holder_and_only_its_pages(prefill_side):
    nixl_side = next(t for t in prefill_side.server._transports if t.kind is KVTransport.NIXL)
    reply, _ = _ask(prefill_side, LockPages("nope", [0]))  # no lease at all
    assert isinstance(reply, PagesReply) and "unknown" in reply.error
    reply, _ = _ask(prefill_side, LockPages("lease", prefill_side.pages[:1], b"forged"))
    assert isinstance(reply, PagesReply) and "token" in reply.error
    assert nixl_side._nixl is None  # no agent made, nothing registered, for peers without a lease
    wanted = prefill_side.pages[:2]
    reply, _ = _ask(prefill_side, LockPages("lease", wanted, prefill_side.token))
    assert isinstance(reply, PoolDescription)
    # What it registered (and described) is the locked pages: K and V of each layer, a region per run of ids.
    runs = len(_runs(sorted(wanted)))
    assert nixl_side._exposed["lease"].descCount() == 2 * LAYERS * runs
    reply, _ = _ask(prefill_side, UnlockPages("lease", b""))
    assert "token" in reply.error and "lease" in nixl_side._exposed  # a forged unlock ends nothing
    reply, _ = _ask(prefill_side, UnlockPages("lease", prefill_side.token))
    assert reply == PagesReply() and nixl_side._exposed == {}  # deregistered with the read
    assert prefill_side.inbox.get(timeout=5) == LeasePulled("lease")


def test_a_server_registers_no_nixl_unless_nixl_is_its_transport(tmp_path):
    context = zmq.Context()
    leases = KVLeases(KVCacheManager(PAGES, PAGE_SIZE))
    pool = SimpleNamespace(layers=[(torch.zeros(PAGES, PAGE_SIZE, HEADS, DIM),) * 2])
    server = KVServer(context, f"ipc://{tmp_path}/kv.ipc", pool, leases, queue.Queue(), structlog.get_logger())
    try:
        assert [t.kind for t in server._transports] == [KVTransport.ZMQ]  # the default: frames only
    finally:
        server._socket.close()
        context.destroy(linger=0)
