"""Shared pieces of the page-pool and scheduler tests: sequences, a tiny real KV pool, expected hash chains, a
reference of what each page holds, and a scheduler driven like the engine drives it, minus the model."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from types import SimpleNamespace

import torch

from gpu_runtime.engine_config import SchedulerConfig
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.kv_cache import page_hashes
from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_cache.page_hashes import page_hash  # the original: count_page_hashes never counts these
from gpu_runtime.scheduler import Scheduler, SchedulerOutput
from gpu_runtime.sequence import Sequence

SALT = b"model-a"
_arrivals = itertools.count()  # sequences made later arrive later, even within one clock tick


def make_seq(
    name: str,
    prompt: list[int] | None = None,
    max_tokens: int = 16,
    *,
    priority: Priority = Priority.INTERACTIVE,
    cache_salt: str = "",
) -> Sequence:
    return Sequence(
        name,
        [1, 2, 3] if prompt is None else list(prompt),
        SamplingParams(max_tokens=max_tokens),
        max_model_len=1 << 20,
        eos_token_ids=frozenset(),
        priority=priority,
        cache_salt=cache_salt,
        arrival_order=next(_arrivals),
    )


def tiny_pool(num_pages: int, page_size: int) -> KVPool:
    config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
    return KVPool(config, num_pages, page_size, torch.float64, "cpu")


def chain_hashes(
    tokens: list[int], page_size: int, num_pages: int, salt: bytes = SALT, cache_salt: str = ""
) -> list[bytes]:
    """The chained content hashes of the first `num_pages` full pages of `tokens`, written out independently
    of PageHasher: the first page is salted with the model's salt and the request's cache salt, the rest chain."""
    hashes, parent = [], b""
    for i in range(num_pages):
        page_salt = salt + b"\0" + cache_salt.encode() if i == 0 else b""
        parent = page_hash(parent, tokens[i * page_size : (i + 1) * page_size], page_salt)
        hashes.append(parent)
    return hashes


def count_page_hashes(monkeypatch) -> list[int]:
    """Counts the pages the runtime hashes from here on (one page_hash call each), in a one-item list."""
    calls = [0]

    def counting_page_hash(parent: bytes, token_ids: list[int], salt: bytes = b"") -> bytes:
        calls[0] += 1
        return page_hash(parent, token_ids, salt)

    monkeypatch.setattr(page_hashes, "page_hash", counting_page_hash)
    return calls


class PageContents:
    """What each page's K/V holds, in a real KVPool: slot s holds an id naming the context that produced it.

    K/V at position i depends on tokens[0..i], so the id names that whole tuple, and the cache salt of the
    request that computed it: the K/V itself would be the same for another salt, but serving it across salts
    is a leak, so here it shows up as foreign content. V holds minus K, so a copy that moved only one of them
    shows up too. Garbage (a raw holder's scratch data) has negative ids.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.pool = tiny_pool(num_pages, page_size)
        self._ids: dict[tuple, int] = {}
        self._garbage = 0

    def id_of(self, context: list[int] | tuple[int, ...], cache_salt: str = "") -> int:
        return self._ids.setdefault((cache_salt, *context), len(self._ids) + 1)

    def expected(self, tokens: list[int] | tuple[int, ...], page_index: int, cache_salt: str = "") -> list[float]:
        """The ids page `page_index` of a sequence with these tokens holds once computed."""
        start = page_index * self.page_size
        return [float(self.id_of(tokens[: start + s + 1], cache_salt)) for s in range(self.page_size)]

    def _write(self, page: int, slot: int, value: float) -> None:
        for k, v in self.pool.layers:
            k[page, slot, 0, 0] = value
            v[page, slot, 0, 0] = -value

    def write_context(self, page: int, slot: int, context: list[int], cache_salt: str = "") -> None:
        self._write(page, slot, float(self.id_of(context, cache_salt)))

    def scribble(self, page: int) -> None:
        for slot in range(self.page_size):
            self._garbage -= 1
            self._write(page, slot, float(self._garbage))

    def read(self, page: int) -> list[float]:
        k, v = self.pool.layers[0]
        keys = k[page, :, 0, 0].tolist()
        assert v[page, :, 0, 0].tolist() == [-x for x in keys], f"page {page}: K and V disagree"
        return keys


# -- a scheduler with no model ------------------------------------------------------------------------------


def make_scheduler(
    num_pages: int = 64,
    page_size: int = 4,
    enable_prefix_caching: bool = True,
    salt: bytes = SALT,
    window: int | None = None,
    **options,
) -> Scheduler:
    """A Scheduler over a KVCacheManager of `num_pages` pages (`window`: every layer's sliding window, if the model
    has one); `options` are SchedulerConfig's fields."""
    kv = KVCacheManager(num_pages, page_size, enable_prefix_caching, salt, window)
    return Scheduler(SchedulerConfig(**options), kv)


def _token_zero(seq: Sequence) -> int:
    return 0


def fake_step(
    scheduler: Scheduler, out: SchedulerOutput, token_of: Callable[[Sequence], int] = _token_zero
) -> list[Sequence]:
    """What LLMEngine.step does with a schedule, minus the forward: the step's K/V counts as computed, every
    sequence whose scheduled tokens reached the end of its known tokens samples `token_of(seq)`, and those
    that finished leave. Returns the sequences that sampled, in the engine's order (decodes, then prefills)."""
    if out.is_empty:
        return []
    work = [(seq, 1) for seq in out.decodes] + [(w.seq, w.num_new_tokens) for w in out.prefills]
    sampling = [seq for seq, num_new in work if seq.num_computed_tokens + num_new == seq.num_tokens]
    scheduler.update_after_step(out)
    for seq in sampling:
        seq.append_token(token_of(seq), None)
        if seq.finish_reason is not None:
            scheduler.finish(seq, seq.finish_reason)
    return sampling


def run_steps(scheduler: Scheduler, max_steps: int = 10_000, token_of=_token_zero) -> list[SchedulerOutput]:
    """Schedules and fake-steps until nothing is left; returns every step's schedule."""
    steps = []
    while scheduler.has_unfinished():
        assert len(steps) < max_steps, f"still unfinished after {max_steps} steps"
        steps.append(scheduler.schedule())
        fake_step(scheduler, steps[-1], token_of)
    return steps
