"""A handover's byte movers, each against a real KV server thread over ipc://: ZeroMQ frames always, NIXL (UCX,
host memory over loopback) where it imports. The pulled pages equal the pool's, pages not leased are refused,
and an expired lease is named."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import structlog
import torch
import zmq

from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.nixl_transport import nixl_available
from gpu_runtime.kv_transfer.puller import KVPuller, PagesPulled, PullJob
from gpu_runtime.kv_transfer.server import KVServer, LeasePulled
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
    server = KVServer(context, address, pool, leases, inbox, log)
    server.start()
    outside = next(page for page in range(PAGES) if page not in pages)
    yield SimpleNamespace(pool=pool, address=address, inbox=inbox, pages=pages, outside=outside, context=context)
    server.stop()
    server.join(timeout=5)
    context.destroy(linger=0)


def _pull(side, transport: str, lease: str, pages: list[int]) -> PagesPulled:
    inbox = queue.Queue()
    puller = KVPuller(side.context, inbox, timeout_s=20, max_bytes=1 << 26, transport=transport)
    puller.start()
    puller.pull(PullJob("r", side.address, lease, pages))
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
