"""A decode worker's pull that fails after its pages arrived (a malformed pull, an import that raises, a request the
engine then chokes on) still ends its request, as kv_load_failure says, and holds no page: before, any failure but
a ValueError escaped Handover.pulled, so the request never got a final delta and the pages taken stayed taken.
And a decode worker that takes no page of a lease (it has them cached, or they cannot serve it) releases the lease
at once: before, its prefill worker held those pages for nobody until the lease expired (30 s by default), and a
draining prefill worker waited that long to exit."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import structlog
import torch

from common.lanes import KVLoadFailure
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import AddRequest, KVTransferParams, RequestDelta
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.puller import LeaseRelease, PagesPulled, PullJob
from gpu_runtime.sequence import Sequence
from gpu_runtime.worker import handover as handover_module
from gpu_runtime.worker.handover import Handover

pytestmark = pytest.mark.fast

NUM_PAGES, PAGE_SIZE, NUM_LAYERS, KV_HEADS, HEAD_DIM = 8, 4, 2, 1, 2
PROMPT = list(range(1, 11))  # two full pages and a partial one


class FakeEngine:
    """What a decode worker's Handover touches of its engine: a real page pool and prefix cache, and no model."""

    def __init__(self):
        self.kv = KVCacheManager(NUM_PAGES, PAGE_SIZE)
        shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        self.runner = SimpleNamespace(pool=SimpleNamespace(layers=[(torch.zeros(shape), torch.zeros(shape))
                                                                   for _ in range(NUM_LAYERS)]))  # fmt: skip
        self.leases = KVLeases(self.kv)
        self.config = SimpleNamespace(enable_prefix_caching=True)

    def unfinished_request_ids(self) -> list[str]:
        return []


class FakePuller:
    """KVPuller's interface, without its thread: the test answers each pull itself."""

    def __init__(self, *args, **kwargs):
        self.jobs = []

    def start(self) -> None:
        pass

    def pull(self, job) -> None:
        self.jobs.append(job)

    def release(self, job) -> None:
        self.jobs.append(job)


def _decode_side(monkeypatch, load_failure: KVLoadFailure = KVLoadFailure.RECOMPUTE,
                 salt: str = "tenant-a") -> tuple[Handover, FakeEngine, AddRequest]:  # fmt: skip
    """A decode worker's Handover, and a request handed over with a lease on its prompt's two full pages."""
    monkeypatch.setattr(handover_module, "KVPuller", FakePuller)
    engine = FakeEngine()
    handover = Handover(engine, None, queue.Queue(), structlog.get_logger(), worker_id="decode/0", kv_address="",
                        lease_seconds=5.0, load_failure=load_failure)  # fmt: skip
    hashes = engine.kv.hasher.hash_tokens(PROMPT[: 2 * PAGE_SIZE], "tenant-a")
    params = KVTransferParams(remote_engine_id="prefill/0", remote_request_id="r1", remote_address="ipc:///kv",
                              remote_block_ids=[5, 6], remote_page_hashes=hashes, remote_num_tokens=2 * PAGE_SIZE,
                              remote_lease_token=b"token")  # fmt: skip
    message = AddRequest("r1", PROMPT, SamplingParams(max_tokens=4), Priority.INTERACTIVE, cache_salt=salt,
                         kv_transfer_params=params)  # fmt: skip
    return handover, engine, message


def _pending(monkeypatch, load_failure: KVLoadFailure) -> tuple[Handover, FakeEngine, AddRequest]:
    """A decode worker's Handover with one request waiting for its two pages."""
    handover, engine, message = _decode_side(monkeypatch, load_failure)
    assert handover.add(message, admit=_refuse) == [] and handover.has_pending
    return handover, engine, message


def _refuse(message: AddRequest) -> list[RequestDelta]:
    raise AssertionError("admitted before its pages came")


def _pages(num_pages: int = 2, head_dim: int = HEAD_DIM) -> torch.Tensor:
    return torch.ones(NUM_LAYERS, num_pages, PAGE_SIZE, KV_HEADS, head_dim)


def _ended(deltas: list[RequestDelta], admitted: list[AddRequest], message: AddRequest,
           load_failure: KVLoadFailure) -> None:  # fmt: skip
    """The request ended as kv_load_failure says: computed here whole, or failed for the client to retry."""
    if load_failure == KVLoadFailure.RECOMPUTE:
        assert admitted == [message] and deltas == []
    else:
        (delta,) = deltas
        assert admitted == [] and delta.finish_reason is FinishReason.ERROR and delta.retryable
        assert "could not be moved to the decode worker" in delta.error


@pytest.mark.parametrize("load_failure", list(KVLoadFailure))
def test_a_malformed_pull_ends_its_request_and_takes_no_page(monkeypatch, load_failure):
    handover, engine, message = _pending(monkeypatch, load_failure)
    admitted = []
    wrong = _pages(head_dim=HEAD_DIM + 1)  # not this pool's shape: import_pages raised RuntimeError part-way
    deltas = handover.pulled(PagesPulled("r1", wrong, wrong), admit=lambda m: admitted.append(m) or [])
    _ended(deltas, admitted, message, load_failure)
    assert engine.kv.allocator.num_used_pages == 0 and engine.kv.allocator.num_cached_pages == 0
    assert handover.stats.pull_failures == 1 and not handover.has_pending


@pytest.mark.parametrize("load_failure", list(KVLoadFailure))
def test_an_import_that_raises_ends_its_request(monkeypatch, load_failure):
    handover, engine, message = _pending(monkeypatch, load_failure)

    def failing_import(kv, pool, export):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")  # what a failing device raises

    monkeypatch.setattr(handover_module, "import_pages", failing_import)
    admitted = []
    deltas = handover.pulled(PagesPulled("r1", _pages(), _pages()), admit=lambda m: admitted.append(m) or [])
    _ended(deltas, admitted, message, load_failure)
    assert engine.kv.allocator.num_used_pages == 0 and handover.stats.pull_failures == 1


def test_a_request_the_engine_chokes_on_after_its_pull_fails_alone(monkeypatch):
    handover, engine, message = _pending(monkeypatch, KVLoadFailure.RECOMPUTE)

    def choking_admit(message: AddRequest) -> list[RequestDelta]:
        raise TypeError("an engine bug")

    (delta,) = handover.pulled(PagesPulled("r1", _pages(), _pages()), admit=choking_admit)
    assert delta.request_id == "r1" and delta.finish_reason is FinishReason.ERROR and "TypeError" in delta.error
    assert delta.num_prompt_tokens == len(PROMPT) and not delta.retryable
    # Its pages were imported: free and cached, held by no one, like any other cached page.
    assert engine.kv.allocator.num_used_pages == 0 and engine.kv.allocator.num_cached_pages == 2


def test_a_good_pull_is_imported_and_admitted(monkeypatch):
    handover, engine, message = _pending(monkeypatch, KVLoadFailure.FAIL)
    admitted = []
    assert handover.pulled(PagesPulled("r1", _pages(), _pages()), admit=lambda m: admitted.append(m) or []) == []
    assert admitted == [message] and handover.stats.pulled_pages == 2 and handover.stats.pull_failures == 0
    assert engine.kv.allocator.num_cached_pages == 2 and engine.kv.allocator.num_used_pages == 0


def _cache_prompt_pages(engine: FakeEngine, salt: str) -> None:
    """The prompt's two full pages computed here before (another request with the same prompt, say)."""
    seq = Sequence("earlier", PROMPT, SamplingParams(max_tokens=1), max_model_len=64, eos_token_ids=frozenset(),
                   cache_salt=salt)  # fmt: skip
    engine.kv.hash_new_pages(seq)
    assert engine.kv.try_admit(seq, engine.kv.find_cached_prefix(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    engine.kv.commit_full_pages(seq)
    engine.kv.release(seq)


@pytest.mark.parametrize("why", ["cached here", "other contents", "no prefix cache", "kv groups"])
def test_a_lease_the_decode_worker_takes_no_page_of_is_released_at_once(monkeypatch, why):
    """ "kv groups": a mixed worker of a hybrid model (its pages hold one group's layers each), to which admission
    routed a handed-over request: it computes the prompt itself rather than pull pages it cannot use."""
    handover, engine, message = _decode_side(monkeypatch, salt="tenant-b" if why == "other contents" else "tenant-a")
    if why == "cached here":
        _cache_prompt_pages(engine, "tenant-a")
    if why == "no prefix cache":
        engine.config.enable_prefix_caching = False
    if why == "kv groups":
        engine.kv = KVCacheManager(NUM_PAGES, PAGE_SIZE, windows=(None, 4))
    admitted = []
    assert handover.add(message, admit=lambda m: admitted.append(m) or []) == []
    assert admitted == [message] and not handover.has_pending  # admitted now: nothing to wait for
    (job,) = handover._puller.jobs
    assert job == LeaseRelease("ipc:///kv", "r1", b"token")  # the prefill worker frees its pages now


def test_a_lease_with_pages_missing_here_is_pulled_not_released(monkeypatch):
    handover, _, message = _decode_side(monkeypatch)
    assert handover.add(message, admit=_refuse) == []
    (job,) = handover._puller.jobs
    assert isinstance(job, PullJob) and job.page_ids == [5, 6]  # the pull's reply releases it there
