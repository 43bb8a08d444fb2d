"""PageAllocator + KVCacheManager with prefix caching, driven the way the scheduler and engine drive them.

A hypothesis state machine admits requests whose prompts share prefixes (a tiny vocabulary, so pages
repeat), computes them chunk by chunk, samples tokens, preempts and re-admits them, finishes them, and
lets "raw holders" (other users of the allocator) allocate, share, free and import pages, forcing
evictions. A reference model tracks every page's owners, its registered hash and the LRU order of cached
free pages; after every step the pool must agree with it through its public API.

The K/V a page holds is simulated in a real (tiny, CPU) KVPool: slot s of a page holds a number naming
the whole context the model saw up to that position, so serving stale or foreign content from the prefix
cache shows up as a mismatch, whatever the bookkeeping claims.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_cache.manager import KVCacheManager, PrefixMatch, page_hash
from gpu_runtime.kv_cache.page_allocator import OutOfPagesError, PageAllocator
from gpu_runtime.kv_cache.transfer import PageExport, export_pages, import_pages
from gpu_runtime.sampling_params import SamplingParams
from gpu_runtime.sequence import Sequence

VOCAB = 3  # so prompts, and the pages they fill, repeat often
MAX_SEQS = 5
NUM_RAW_HOLDERS = 3
SALT = b"model-a"

tokens_st = st.lists(st.integers(0, VOCAB - 1), max_size=6)
prefix_st = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=10)
HISTORY = 4  # the last few conversations a new request may continue


def _seq(name: str, prompt: list[int] | None = None, max_tokens: int = 16) -> Sequence:
    return Sequence(
        name,
        [1, 2, 3] if prompt is None else list(prompt),
        SamplingParams(max_tokens=max_tokens),
        max_model_len=1 << 20,
        eos_token_ids=frozenset(),
    )


def _tiny_pool(num_pages: int, page_size: int) -> KVPool:
    config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
    return KVPool(config, num_pages, page_size, torch.float64, "cpu")


def _chain(tokens: list[int], page_size: int, num_pages: int, salt: bytes = SALT) -> list[bytes]:
    """The chained content hashes of the first `num_pages` full pages of `tokens`."""
    hashes, parent = [], b""
    for i in range(num_pages):
        parent = page_hash(parent, tokens[i * page_size : (i + 1) * page_size], salt)
        hashes.append(parent)
    return hashes


class PageContents:
    """What each page's K/V holds, in a real KVPool: slot s holds an id naming the context that produced it.

    K/V at position i depends on tokens[0..i], so the id names that whole tuple; V holds minus K, so a copy
    that moved only one of them shows up too. Garbage (a raw holder's scratch data) has negative ids.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.pool = _tiny_pool(num_pages, page_size)
        self._ids: dict[tuple[int, ...], int] = {}
        self._garbage = 0

    def id_of(self, context: list[int] | tuple[int, ...]) -> int:
        return self._ids.setdefault(tuple(context), len(self._ids) + 1)

    def expected(self, tokens: list[int] | tuple[int, ...], page_index: int) -> list[float]:
        """The ids page `page_index` of a sequence with these tokens holds once computed."""
        start = page_index * self.page_size
        return [float(self.id_of(tokens[: start + s + 1])) for s in range(self.page_size)]

    def _write(self, page: int, slot: int, value: float) -> None:
        for k, v in self.pool.layers:
            k[page, slot, 0, 0] = value
            v[page, slot, 0, 0] = -value

    def write_context(self, page: int, slot: int, context: list[int]) -> None:
        self._write(page, slot, float(self.id_of(context)))

    def scribble(self, page: int) -> None:
        for slot in range(self.page_size):
            self._garbage -= 1
            self._write(page, slot, float(self._garbage))

    def read(self, page: int) -> list[float]:
        k, v = self.pool.layers[0]
        keys = k[page, :, 0, 0].tolist()
        assert v[page, :, 0, 0].tolist() == [-x for x in keys], f"page {page}: K and V disagree"
        return keys


class PrefixCachePoolMachine(RuleBasedStateMachine):
    """Sequences go through the manager as the scheduler uses it; raw holders use the allocator directly."""

    @initialize(
        num_pages=st.integers(1, 16),
        page_size=st.integers(1, 4),
        caching=st.sampled_from([True, True, True, False]),
        prefixes=st.lists(prefix_st, min_size=1, max_size=3),
    )
    def setup(self, num_pages: int, page_size: int, caching: bool, prefixes: list[list[int]]) -> None:
        self.kv = KVCacheManager(num_pages, page_size, enable_prefix_caching=caching, salt=SALT)
        self.allocator = self.kv.allocator
        self.P = page_size
        self.caching = caching
        self.prefixes = prefixes
        self.content = PageContents(num_pages, page_size)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []  # hold no pages: not admitted yet, or preempted
        self.raw: list[list[int]] = [[] for _ in range(NUM_RAW_HOLDERS)]
        self.history: list[list[int]] = []  # prompt + outputs of requests that ended or were preempted
        self.next_request = 0
        self.samples = 0
        # The reference model of the allocator: registered hashes, and cached free pages, oldest first.
        self.hash_of: dict[int, bytes] = {}
        self.page_of: dict[bytes, int] = {}
        self.lru: list[int] = []
        self.evictions = 0
        self.hash_tokens: dict[bytes, tuple[int, ...]] = {}  # every hash seen -> the tokens it names
        self.duplicates: set[tuple[str, int]] = set()  # (request, page index) committed while cached elsewhere
        self.released_hashes: dict[str, list[bytes]] = {}  # preempted request -> the page hashes it had
        self.query_tokens = 0
        self.hit_tokens = 0

    # -- the reference model ----------------------------------------------------------------------------

    def _holders(self) -> list[list[int]]:
        return [s.page_ids for s in self.running] + self.raw

    def _refs(self) -> Counter:
        return Counter(page for holder in self._holders() for page in holder)

    def _empties(self) -> set[int]:
        refs = self._refs()
        return {p for p in range(self.kv.num_pages) if refs[p] == 0 and p not in self.lru}

    def _all_seqs(self) -> list[Sequence]:
        return self.running + self.waiting

    def _snapshot(self) -> tuple:
        a, n = self.allocator, self.kv.num_pages
        return (
            [a.ref_count(p) for p in range(n)],
            [a.hash_of(p) for p in range(n)],
            [a.is_evictable(p) for p in range(n)],
            a.num_free_pages,
            a.num_cached_pages,
            a.num_evictions,
            self.kv.num_prefix_query_tokens,
            self.kv.num_prefix_hit_tokens,
            [
                (s.request_id, list(s.page_ids), list(s.page_hashes), s.num_computed_tokens, s.num_cached_tokens)
                for s in self._all_seqs()
            ],
            [list(r) for r in self.raw],
        )

    def _base(self, index: int) -> list[int]:
        """A shared system prompt, or an earlier conversation (prompt + outputs) that a follow-up continues."""
        bases = self.prefixes + self.history[-HISTORY:]
        return list(bases[index % len(bases)])

    def _chain(self, tokens: list[int], num_pages: int) -> list[bytes]:
        hashes = _chain(tokens, self.P, num_pages)
        for i, h in enumerate(hashes):
            self.hash_tokens.setdefault(h, tuple(tokens[: (i + 1) * self.P]))
        return hashes

    def _model_allocated(self, pages: list[int], empties: set[int]) -> None:
        """`pages` came from allocate(len(pages)) when `empties` were the empty free pages."""
        n_evict = max(0, len(pages) - len(empties))
        evicted = self.lru[:n_evict]
        assert len(set(pages)) == len(pages), f"allocate handed out a page twice: {pages}"
        assert set(pages) <= empties | set(evicted), (
            f"allocate gave {pages}: not empty pages first, then the oldest cached ({empties}, lru {self.lru})"
        )
        assert set(evicted) <= set(pages)
        del self.lru[:n_evict]
        for page in evicted:
            self._model_forget(page)
        self.evictions += n_evict

    def _model_forget(self, page: int) -> None:
        content_hash = self.hash_of.pop(page, None)
        if content_hash is not None:
            del self.page_of[content_hash]

    def _model_free(self, pages: list[int], refs: Counter) -> None:
        refs = Counter(refs)
        for page in pages:
            refs[page] -= 1
            if refs[page] == 0 and page in self.hash_of:
                self.lru.append(page)

    def _model_share(self, page: int) -> None:
        if page in self.lru:
            self.lru.remove(page)

    def _model_register(self, page: int, content_hash: bytes) -> bool:
        if content_hash in self.page_of or page in self.hash_of:
            return False
        self.hash_of[page] = content_hash
        self.page_of[content_hash] = page
        return True

    # -- checks shared by the rules ---------------------------------------------------------------------------

    def _check_match(self, tokens: list[int], max_tokens: int | None, match: PrefixMatch) -> None:
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        # First what matters most: every page served holds exactly the K/V of these tokens.
        for i, page in enumerate(match.page_ids):
            assert self.content.read(page) == self.content.expected(tokens, i), (
                f"find_cached_prefix serves page {page} for page {i} of {tokens}, but it holds other K/V"
            )
        pages, hashes = [], []
        if self.caching:
            for h in self._chain(tokens, limit // self.P):
                if h not in self.page_of:
                    break
                pages.append(self.page_of[h])
                hashes.append(h)
        assert match.hashes == hashes and match.page_ids == pages, "find_cached_prefix: not the longest cached run"
        assert match.num_tokens(self.P) == len(pages) * self.P <= limit

    def _release(self, seq: Sequence) -> None:
        refs = self._refs()
        pages = list(seq.page_ids)
        self.history.append(seq.prompt_token_ids + seq.output_token_ids)
        self.kv.release(seq)
        assert seq.page_ids == [] and seq.page_hashes == [] and seq.num_computed_tokens == 0
        self._model_free(pages[::-1], refs)
        self.duplicates = {d for d in self.duplicates if d[0] != seq.request_id}
        if seq in self.running:
            self.running.remove(seq)

    def _admit(self, seq: Sequence, data=None) -> bool:
        """The scheduler's admission: look up the cached prefix, then try_admit it plus some fresh tokens.

        Without `data`, as the engine's own step does: the cached prefix plus a chunk of two pages' worth.
        """
        tokens = seq.prompt_token_ids + seq.output_token_ids
        assert seq.token_ids_range(0, seq.num_tokens) == tokens
        before = self._snapshot()
        match = self.kv.find_cached_prefix(tokens, seq.num_tokens - 1)
        assert self._snapshot() == before, "find_cached_prefix changed the pool"
        self._check_match(tokens, seq.num_tokens - 1, match)
        if seq.request_id in self.released_hashes:
            still_cached = 0
            for h in self.released_hashes[seq.request_id]:
                if self.allocator.lookup(h) is None:
                    break
                still_cached += 1
            assert len(match.page_ids) >= still_cached, "a preempted request lost its own still-cached pages"

        matched = match.num_tokens(self.P)
        if data is None:
            n = min(seq.num_tokens, matched + 2 * self.P)
        else:
            n = data.draw(st.integers(matched, seq.num_tokens), label="admit num_tokens")
        revived = [p for p in match.page_ids if p in self.lru]
        fresh = self.kv.pages_for(n) - len(match.page_ids)
        expect = fresh + len(revived) <= self.allocator.num_free_pages
        empties = self._empties()
        ok = self.kv.try_admit(seq, match, n)
        assert ok == expect, f"try_admit said {ok}: {fresh} fresh + {len(revived)} revived pages"
        if not ok:
            assert self._snapshot() == before, "a failed try_admit changed the pool"
            return False
        for page in match.page_ids:
            self._model_share(page)
        self._model_allocated(seq.page_ids[len(match.page_ids) :], empties)
        assert seq.page_ids[: len(match.page_ids)] == match.page_ids
        assert len(seq.page_ids) == max(self.kv.pages_for(n), len(match.page_ids))
        assert seq.page_hashes == match.hashes
        assert seq.num_computed_tokens == matched
        if seq.num_preemptions == 0:
            assert seq.num_cached_tokens == matched
            if self.caching:
                self.query_tokens += seq.num_tokens
                self.hit_tokens += matched
        self.waiting.remove(seq)
        self.running.append(seq)
        self.released_hashes.pop(seq.request_id, None)
        return True

    def _commit(self, seq: Sequence) -> None:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        have = len(seq.page_hashes)
        num_full = seq.num_computed_tokens // self.P
        chain = self._chain(tokens, num_full)
        before = self._snapshot()
        self.kv.commit_full_pages(seq)
        if not self.caching:
            assert self._snapshot() == before, "commit_full_pages registered pages with caching off"
            return
        assert seq.page_hashes == chain, "commit_full_pages: hashes are not the chain of the computed pages"
        for i in range(have, num_full):
            page = seq.page_ids[i]
            assert page not in self.hash_of, f"page {page} was committed while it already held other content"
            if not self._model_register(page, chain[i]):
                self.duplicates.add((seq.request_id, i))  # computed twice at once: the first copy stays

    def _raw_allocate(self, holder: int, n: int) -> None:
        before = self._snapshot()
        if n > self.allocator.num_free_pages:
            assert not self.allocator.can_allocate(n)
            with pytest.raises(OutOfPagesError):
                self.allocator.allocate(n)
            assert self._snapshot() == before, "a failed allocate changed the pool"
            return
        assert self.allocator.can_allocate(n)
        empties, free_before = self._empties(), self.allocator.num_free_pages
        pages = self.allocator.allocate(n)
        assert len(pages) == n
        self._model_allocated(pages, empties)
        for page in pages:
            assert self.allocator.ref_count(page) == 1 and self.allocator.hash_of(page) is None
            self.content.scribble(page)  # whatever the new owner writes there
        assert self.allocator.num_free_pages == free_before - n
        self.raw[holder].extend(pages)

    # -- rules: the scheduler and engine --------------------------------------------------------------------------

    @precondition(lambda self: len(self.running) + len(self.waiting) < MAX_SEQS)
    @rule(base=st.integers(0, 7), suffix=tokens_st, max_tokens=st.integers(1, 6), data=st.data())
    def new_request(self, base: int, suffix: list[int], max_tokens: int, data) -> None:
        prompt = (self._base(base) + suffix) or [0]
        seq = _seq(f"r{self.next_request}", prompt, max_tokens)
        self.next_request += 1
        self.waiting.append(seq)
        self._admit(seq, data)

    @precondition(lambda self: len(self.running) + len(self.waiting) + 1 < MAX_SEQS)
    @rule(base=st.integers(0, 7), suffixes=st.lists(tokens_st, min_size=2, max_size=2))
    def burst_of_requests(self, base: int, suffixes: list[list[int]]) -> None:
        """Two requests sharing a prefix queue up; the next engine step admits both, so both compute the
        same pages at once (the second copy of each page stays unregistered)."""
        for suffix in suffixes:
            prompt = (self._base(base) + suffix) or [0]
            self.waiting.append(_seq(f"r{self.next_request}", prompt, max_tokens=4))
            self.next_request += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_waiting(self, data) -> None:
        """Retries a request that found no room, or re-admits a preempted one (prompt + its outputs)."""
        self._admit(data.draw(st.sampled_from(self.waiting), label="waiting seq"), data)

    def _compute(self, seq: Sequence, k: int, sampled: int) -> bool:
        """One step's work for `seq`: reserve, write the K/V of k tokens, commit full pages, maybe sample.

        False (and nothing changed) when try_reserve finds too few pages.
        """
        assert 1 <= k <= seq.num_uncomputed_tokens
        start, target = seq.num_computed_tokens, seq.num_computed_tokens + k
        old = list(seq.page_ids)
        missing = self.kv.pages_for(target) - len(old)
        expect = missing <= self.allocator.num_free_pages
        before, empties = self._snapshot(), self._empties()
        ok = self.kv.try_reserve(seq, target)
        assert ok == expect, f"try_reserve said {ok} with {missing} pages missing"
        if not ok:
            assert self._snapshot() == before, "a failed try_reserve changed the pool"
            return False
        assert seq.page_ids[: len(old)] == old, "try_reserve rewrote pages the sequence already held"
        if missing > 0:
            assert len(seq.page_ids) == len(old) + missing
            self._model_allocated(seq.page_ids[len(old) :], empties)
        else:
            assert self._snapshot() == before
        # The forward pass writes the K/V of positions [start, target).
        tokens = seq.prompt_token_ids + seq.output_token_ids
        for pos in range(start, target):
            page = seq.page_ids[pos // self.P]
            assert self.allocator.hash_of(page) is None, f"{seq.request_id} writes into cached page {page}"
            assert not any(page in s.page_ids for s in self.running if s is not seq), (
                f"{seq.request_id} writes into page {page}, which another sequence holds"
            )
            self.content.write_context(page, pos % self.P, tokens[: pos + 1])
        seq.num_computed_tokens = target
        self._commit(seq)  # as the engine does: commit, then append the sampled token
        if target == seq.num_tokens:  # the prompt (or last token) is done: the step samples a token
            seq.append_token(sampled, None)
            if seq.finish_reason is not None:
                self._release(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        hashes = list(seq.page_hashes)
        self._release(seq)
        seq.num_preemptions += 1  # as the scheduler does: a recompute does not count its prompt again
        self.waiting.append(seq)
        self.released_hashes[seq.request_id] = hashes

    @rule()
    def engine_step(self) -> None:
        """A scheduler step: every running sequence advances a chunk (when pages run out, the latest
        admitted is preempted), then waiting requests are admitted in order until one does not fit."""
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted earlier in this step
            k = min(seq.num_uncomputed_tokens, self.P + 1)
            self.samples += 1
            while not self._compute(seq, k, self.samples % VOCAB):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
        for seq in list(self.waiting):
            if not self._admit(seq):
                break

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute(self, data) -> None:
        """One sequence computes k tokens (a prefill chunk or a decode), if try_reserve finds the pages."""
        seq = data.draw(st.sampled_from(self.running), label="running seq")
        k = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="tokens to compute")
        self._compute(seq, k, data.draw(st.integers(0, VOCAB - 1), label="sampled"))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(data.draw(st.sampled_from(self.running), label="victim"))

    @precondition(lambda self: self.running or self.waiting)
    @rule(data=st.data())
    def finish(self, data) -> None:
        """Finished or aborted, running or waiting: its pages go back."""
        seq = data.draw(st.sampled_from(self.running + self.waiting), label="finished seq")
        self._release(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.released_hashes.pop(seq.request_id, None)

    # -- rules: other users of the allocator ---------------------------------------------------------------------

    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), n=st.integers(0, 4))
    def raw_allocate(self, holder: int, n: int) -> None:
        self._raw_allocate(holder, n)

    @precondition(lambda self: self.lru)
    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), data=st.data())
    def evict_by_allocating(self, holder: int, data) -> None:
        """Takes more pages than are empty, so the oldest cached pages lose their content; a transient user
        (a staging buffer) gives them back at once, a lasting one keeps them."""
        empties = len(self._empties())
        n = data.draw(st.integers(empties + 1, self.allocator.num_free_pages), label="pages")
        evictions = self.allocator.num_evictions
        evicted = [(p, self.hash_of[p]) for p in self.lru[: n - empties]]
        kept = len(self.raw[holder])
        self._raw_allocate(holder, n)
        assert self.allocator.num_evictions == evictions + n - empties
        for page, content_hash in evicted:
            assert self.allocator.lookup(content_hash) is None, f"evicted page {page} is still found by its hash"
            assert self.allocator.hash_of(page) is None
        if data.draw(st.booleans(), label="transient"):
            pages, refs = self.raw[holder][kept:], self._refs()
            self.allocator.free(pages)
            self._model_free(pages, refs)
            del self.raw[holder][kept:]

    @rule(now=st.integers(0, 2))
    def evict_all_cached(self, now: int) -> None:
        if now != 2:
            return
        free_before, cached = self.allocator.num_free_pages, list(self.lru)
        assert self.allocator.evict_all_cached() == len(cached)
        for page in cached:
            self._model_forget(page)
        self.lru = []
        assert self.allocator.num_free_pages == free_before
        assert not any(self.allocator.is_evictable(p) for p in range(self.kv.num_pages))

    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), data=st.data())
    def raw_share(self, holder: int, data) -> None:
        """Adds an owner to a page in use (a shared prefix) or to a cached free page (reviving it)."""
        refs = self._refs()
        candidates = [p for p in range(self.kv.num_pages) if (refs[p] or p in self.lru) and p not in self.raw[holder]]
        if not candidates:
            return
        page = data.draw(st.sampled_from(candidates), label="page to share")
        cached, free_before = page in self.lru, self.allocator.num_free_pages
        self.allocator.share(page)
        self._model_share(page)
        self.raw[holder].append(page)
        assert self.allocator.ref_count(page) == refs[page] + 1
        assert self.allocator.num_free_pages == free_before - cached
        assert self.allocator.hash_of(page) == self.hash_of.get(page), "reviving a page dropped its content"

    @rule(holder=st.integers(0, NUM_RAW_HOLDERS - 1), data=st.data())
    def raw_free(self, holder: int, data) -> None:
        pages = self.raw[holder]
        if not pages:
            return
        chosen = data.draw(st.lists(st.sampled_from(pages), unique=True, min_size=1), label="pages to free")
        refs, free_before = self._refs(), self.allocator.num_free_pages
        self.allocator.free(chosen)
        self._model_free(chosen, refs)
        for page in chosen:
            assert self.allocator.ref_count(page) == refs[page] - 1
            pages.remove(page)
        assert self.allocator.num_free_pages == free_before + sum(1 for p in chosen if refs[p] == 1)

    @rule(data=st.data())
    def misuse_is_rejected(self, data) -> None:
        """Sharing an empty page, or a free list that drops some page more often than it is owned, raises
        ValueError and changes nothing at all."""
        empties = sorted(self._empties())
        if empties and data.draw(st.booleans(), label="share an empty page"):
            page = data.draw(st.sampled_from(empties), label="empty page")
            before = self._snapshot()
            with pytest.raises(ValueError, match=str(page)):
                self.allocator.share(page)
            assert self._snapshot() == before, "a rejected share changed the pool"
            return
        refs = self._refs()
        victim = data.draw(st.integers(0, self.kv.num_pages - 1), label="over-freed page")
        owned = sorted(p for p in refs if refs[p] and p != victim)
        valid = data.draw(st.lists(st.sampled_from(owned), unique=True), label="valid pages") if owned else []
        pages = data.draw(st.permutations(valid + [victim] * (refs[victim] + 1)), label="free list")
        before = self._snapshot()
        with pytest.raises(ValueError, match=str(victim)):
            self.allocator.free(pages)
        assert self._snapshot() == before, "a rejected free changed the pool"

    @rule(base=st.integers(0, 7), suffix=tokens_st)
    def import_prefix(self, base: int, suffix: list[int]) -> None:
        """Another worker's computed pages arrive (transfer.import_pages): they end up free and cached."""
        tokens = self._base(base) + suffix
        num_full = len(tokens) // self.P
        chain = self._chain(tokens, num_full)
        ids = [self.content.expected(tokens, i) for i in range(num_full)]
        keys = torch.tensor(ids, dtype=torch.float64).reshape(1, num_full, self.P, 1, 1)
        export = PageExport(self.P, chain, keys, -keys)
        chain_pages = [self.page_of.get(h) for h in chain]
        missing = [i for i, page in enumerate(chain_pages) if page is None]
        present = [page for page in chain_pages if page is not None]
        revived = [page for page in present if page in self.lru]
        before = self._snapshot()
        if len(missing) + len(revived) > self.allocator.num_free_pages:
            with pytest.raises(ValueError, match="pages"):
                import_pages(self.kv, self.content.pool, export)
            assert self._snapshot() == before, "a rejected import changed the pool"
            return
        empties, refs = self._empties(), self._refs()
        assert import_pages(self.kv, self.content.pool, export) == len(missing)
        # The pages already here were pinned while the missing ones were allocated, then all freed, tail first.
        for page in present:
            self._model_share(page)
        pages = [self.allocator.lookup(chain[i]) for i in missing]
        assert None not in pages, "an imported page is not found by its hash"
        self._model_allocated(pages, empties)
        for page, i in zip(pages, missing, strict=True):
            assert self._model_register(page, chain[i])
            chain_pages[i] = page
        self._model_free(chain_pages[::-1], refs + Counter(chain_pages))
        for i, page in enumerate(chain_pages):
            assert self.content.read(page) == ids[i], f"imported page {i} (page {page}) holds other K/V"
        if self.caching:
            assert self.kv.find_cached_prefix(tokens).page_ids == chain_pages, "the imported prefix is not found"

    @rule(base=st.integers(0, 7), suffix=tokens_st)
    def export_prefix(self, base: int, suffix: list[int]) -> None:
        tokens = self._base(base) + suffix
        before = self._snapshot()
        match = self.kv.find_cached_prefix(tokens)
        self._check_match(tokens, None, match)
        export = export_pages(self.kv, self.content.pool, match)
        assert self._snapshot() == before, "exporting changed the pool"
        assert export.page_hashes == match.hashes
        expected = [self.content.expected(tokens, i) for i in range(len(match.page_ids))]
        assert export.keys.reshape(len(expected), self.P).tolist() == expected
        assert (-export.values).reshape(len(expected), self.P).tolist() == expected

    @rule(now=st.integers(0, 4))
    def drain(self, now: int) -> None:
        """Now and then, everything is released: no page may stay owned, and the cache then empties fully."""
        if now == 4:
            self._drain_and_check()

    def _drain_and_check(self) -> None:
        for seq in list(self.running):
            self._release(seq)
        self.waiting.clear()
        self.released_hashes.clear()
        for holder in self.raw:
            refs = self._refs()
            self.allocator.free(holder)
            self._model_free(holder, refs)
            holder.clear()
        assert self.allocator.num_free_pages == self.kv.num_pages, "pages leaked"
        assert self.allocator.num_used_pages == 0
        assert all(self.allocator.ref_count(p) == 0 for p in range(self.kv.num_pages))
        self.allocator.check_integrity([])
        cached = self.allocator.num_cached_pages
        assert self.allocator.evict_all_cached() == cached == len(self.lru)
        for page in self.lru:
            self._model_forget(page)
        self.lru = []
        assert self.allocator.num_cached_pages == 0

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            self._drain_and_check()

    # -- invariants --------------------------------------------------------------------------------------------

    @invariant()
    def integrity_checks_pass(self) -> None:
        raw_holders = [_seq(f"raw{i}") for i in range(NUM_RAW_HOLDERS)]
        for holder, pages in zip(raw_holders, self.raw, strict=True):
            holder.page_ids = list(pages)
        self.kv.check_integrity(self._all_seqs() + raw_holders)
        self.allocator.check_integrity(self._holders())

    @invariant()
    def pool_agrees_with_model(self) -> None:
        a, n = self.allocator, self.kv.num_pages
        refs = self._refs()
        assert [a.ref_count(p) for p in range(n)] == [refs[p] for p in range(n)], "reference counts != owners"
        assert a.num_free_pages + a.num_used_pages == n
        assert a.num_free_pages == len(self._empties()) + len(self.lru)
        assert a.num_used_pages == sum(1 for p in range(n) if refs[p])
        assert (self.kv.num_free_pages, self.kv.num_used_pages, self.kv.num_pages) == (
            a.num_free_pages,
            a.num_used_pages,
            n,
        )
        assert a.can_allocate(a.num_free_pages) and not a.can_allocate(a.num_free_pages + 1)
        assert [a.hash_of(p) for p in range(n)] == [self.hash_of.get(p) for p in range(n)]
        assert [a.is_evictable(p) for p in range(n)] == [p in self.lru for p in range(n)]
        assert a.num_cached_pages == len(self.hash_of)
        for h in self.hash_tokens:
            assert a.lookup(h) == self.page_of.get(h)
        assert a.num_evictions == self.evictions
        assert (self.kv.num_prefix_query_tokens, self.kv.num_prefix_hit_tokens) == (
            self.query_tokens,
            self.hit_tokens,
        )

    @invariant()
    def cached_pages_hold_their_content(self) -> None:
        """Every page the pool says holds some content (owned or free) really holds that K/V."""
        for page in range(self.kv.num_pages):
            content_hash = self.allocator.hash_of(page)
            if content_hash is None:
                continue
            assert content_hash in self.hash_tokens, f"page {page} is registered under a hash nobody computed"
            tokens = self.hash_tokens[content_hash]
            expected = self.content.expected(tokens, len(tokens) // self.P - 1)
            assert self.content.read(page) == expected, f"cached page {page} lost the content its hash names"

    @invariant()
    def sequences_are_consistent(self) -> None:
        for seq in self.waiting:
            assert (seq.page_ids, seq.page_hashes, seq.num_computed_tokens) == ([], [], 0)
        for seq in self.running:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            computed = seq.num_computed_tokens
            assert 0 <= computed < seq.num_tokens
            assert len(set(seq.page_ids)) == len(seq.page_ids)
            assert len(seq.page_ids) >= self.kv.pages_for(computed)
            assert len(seq.page_hashes) == (computed // self.P if self.caching else 0)
            assert seq.page_hashes == _chain(tokens, self.P, len(seq.page_hashes))
            for i, h in enumerate(seq.page_hashes):
                page = seq.page_ids[i]
                if (seq.request_id, i) in self.duplicates:
                    assert self.allocator.lookup(h) != page and self.allocator.hash_of(page) is None
                else:
                    assert self.allocator.lookup(h) == page, f"{seq.request_id}'s page {i} is not found by its hash"
            # Everything the sequence computed is still in its pages: nobody wrote over them.
            for i in range(self.kv.pages_for(computed)):
                filled = min(self.P, computed - i * self.P)
                got = self.content.read(seq.page_ids[i])[:filled]
                assert got == self.content.expected(tokens, i)[:filled], f"{seq.request_id}'s page {i} overwritten"


PrefixCachePoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixCachePool = PrefixCachePoolMachine.TestCase


# -- deterministic cases --------------------------------------------------------------------------


def _computed(kv: KVCacheManager, name: str, prompt: list[int], num_tokens: int | None = None) -> Sequence:
    """A sequence admitted (from whatever is cached) and computed up to `num_tokens` tokens."""
    seq = _seq(name, prompt)
    num_tokens = len(prompt) if num_tokens is None else num_tokens
    assert kv.try_admit(seq, kv.find_cached_prefix(prompt, len(prompt) - 1), num_tokens)
    seq.num_computed_tokens = num_tokens
    kv.commit_full_pages(seq)
    return seq


def test_pool_needs_at_least_one_page():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    with pytest.raises(ValueError, match="num_pages"):
        KVCacheManager(0, 16)


def test_pages_for_rounds_up():
    manager = KVCacheManager(8, 16)
    assert [manager.pages_for(n) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert manager.fits_pool(8 * 16)
    assert not manager.fits_pool(8 * 16 + 1)


def test_freed_pages_are_reused_and_a_shared_page_survives_one_owner():
    allocator = PageAllocator(2)
    a, b = allocator.allocate(2)
    allocator.share(a)
    allocator.free([a])  # one owner left
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    allocator.free([a, b])
    assert sorted(allocator.allocate(2)) == [a, b]


def test_over_free_of_an_owned_page_raises():
    allocator = PageAllocator(3)
    (page,) = allocator.allocate(1)
    allocator.free([page])
    with pytest.raises(ValueError, match="freed more often than it was owned"):
        allocator.free([page])
    assert allocator.num_free_pages == 3


def test_rejected_free_changes_nothing():
    allocator = PageAllocator(4)
    a, b = allocator.allocate(2)
    allocator.register(a, b"h")
    allocator.free([b])
    with pytest.raises(ValueError):
        allocator.free([a, b])  # b is already free
    assert allocator.ref_count(a) == 1 and allocator.num_free_pages == 3
    assert allocator.lookup(b"h") == a and not allocator.is_evictable(a)


def test_release_then_reserve_again():
    manager = KVCacheManager(4, 4)
    seq = _seq("a")
    assert manager.try_reserve(seq, 16)  # all four pages
    assert not manager.try_reserve(_seq("b"), 1)
    seq.num_computed_tokens = 16
    manager.release(seq)
    assert seq.page_ids == [] and seq.num_computed_tokens == 0
    assert manager.num_free_pages == 4
    assert manager.try_reserve(seq, 5) and len(seq.page_ids) == 2


def test_a_failed_try_reserve_takes_no_page_even_when_some_are_free():
    kv = KVCacheManager(4, 2)
    seq = _seq("a", list(range(9)))
    assert kv.try_reserve(seq, 3)  # two pages
    pages = list(seq.page_ids)
    assert not kv.try_reserve(seq, 9)  # three more needed, two free
    assert seq.page_ids == pages and kv.num_free_pages == 2
    assert kv.try_reserve(seq, 8) and len(seq.page_ids) == 4 and seq.page_ids[:2] == pages
    kv.check_integrity([seq])


def test_register_needs_an_owned_page_and_keeps_the_first_page_for_a_hash():
    allocator = PageAllocator(3)
    with pytest.raises(ValueError, match="free"):
        allocator.register(0, b"x")
    a, b = allocator.allocate(2)
    allocator.register(a, b"x")
    allocator.register(b, b"x")  # the same content computed twice: the first copy stays
    allocator.register(a, b"y")  # a page holds one content
    assert allocator.lookup(b"x") == a and allocator.hash_of(b) is None and allocator.lookup(b"y") is None
    allocator.free([a, b])
    assert allocator.is_evictable(a) and not allocator.is_evictable(b)
    assert allocator.num_free_pages == 3 and allocator.num_cached_pages == 1


def test_allocate_takes_empty_pages_first_then_evicts_the_least_recently_freed():
    allocator = PageAllocator(4)
    pages = allocator.allocate(4)
    for i, page in enumerate(pages[:3]):
        allocator.register(page, bytes([i]))
    allocator.free([pages[1], pages[0], pages[2], pages[3]])  # cached in the order 1, 0, 2
    assert allocator.allocate(1) == [pages[3]]  # the empty one first
    assert allocator.num_evictions == 0
    allocator.share(pages[1])  # revived: no longer evictable, keeps its content
    allocator.free([pages[1]])  # now the most recently freed
    assert allocator.allocate(2) == [pages[0], pages[2]]
    assert allocator.num_evictions == 2
    assert allocator.lookup(bytes([0])) is None and allocator.lookup(bytes([2])) is None
    assert allocator.lookup(bytes([1])) == pages[1]


def test_release_frees_the_tail_first_so_the_head_of_a_prefix_stays_cached():
    kv = KVCacheManager(4, 2)
    seq = _computed(kv, "a", [0, 1, 2, 3, 4, 5, 6], 6)  # three full pages, cached when freed
    kv.release(seq)
    assert kv.num_free_pages == 4 and kv.allocator.num_cached_pages == 3
    hog = kv.allocator.allocate(2)  # the empty page, then one eviction: the last page of the prefix
    assert kv.allocator.num_evictions == 1
    match = kv.find_cached_prefix([0, 1, 2, 3, 4, 5, 6], 6)
    assert match.num_tokens(2) == 4
    kv.allocator.free(hog)


def test_find_cached_prefix_respects_max_tokens_salt_and_caching_off():
    kv = KVCacheManager(8, 2, salt=b"m1")
    prompt = [1, 2, 3, 4, 5]
    seq = _computed(kv, "a", prompt, 4)
    assert kv.find_cached_prefix(prompt).page_ids == seq.page_ids[:2]
    assert kv.find_cached_prefix(prompt, 3).page_ids == seq.page_ids[:1]
    assert kv.find_cached_prefix(prompt, 1).page_ids == []
    assert kv.find_cached_prefix([1, 2, 9, 9]).page_ids == seq.page_ids[:1]
    assert kv.find_cached_prefix([9, 2, 3, 4]).page_ids == []  # a later page never matches without its parents
    other = KVCacheManager(8, 2, salt=b"m2")
    for page, h in zip(other.allocator.allocate(2), seq.page_hashes, strict=True):
        other.allocator.register(page, h)
    assert other.find_cached_prefix(prompt).page_ids == []  # another model's pages never match
    off = KVCacheManager(8, 2, enable_prefix_caching=False)
    seq_off = _computed(off, "b", prompt, 4)
    assert seq_off.page_hashes == [] and off.allocator.num_cached_pages == 0
    assert off.find_cached_prefix(prompt).page_ids == []


def test_a_failed_try_admit_changes_nothing():
    kv = KVCacheManager(3, 2)
    first = _computed(kv, "a", [1, 2, 3, 4, 5], 4)
    kv.release(first)  # two cached pages, one empty
    hog = kv.allocator.allocate(1)  # the empty one
    seq = _seq("b", [1, 2, 3, 4, 7, 7, 7])
    match = kv.find_cached_prefix(seq.prompt_token_ids, 6)
    assert len(match.page_ids) == 2
    assert not kv.try_admit(seq, match, 6)  # reviving two pages + one fresh: only two free
    assert (seq.page_ids, seq.page_hashes, seq.num_computed_tokens) == ([], [], 0)
    assert kv.num_free_pages == 2 and all(kv.allocator.is_evictable(p) for p in match.page_ids)
    assert kv.num_prefix_query_tokens == 5 and kv.num_prefix_hit_tokens == 0  # only "a" counted
    assert kv.try_admit(seq, match, 4)  # the cached prefix alone fits
    assert seq.page_ids == match.page_ids and seq.num_computed_tokens == 4 == seq.num_cached_tokens
    assert kv.num_free_pages == 0
    kv.allocator.check_integrity([seq.page_ids, hog])


def test_import_keeps_the_already_cached_part_of_the_prefix_it_imports():
    """Regression (fixed in 470f139): making room for the missing pages once evicted the cached head."""
    kv = KVCacheManager(3, 1)
    pool = _tiny_pool(3, 1)
    busy = _seq("busy", [9, 9])
    assert kv.try_reserve(busy, 1)  # a running request holds one page
    tokens = [0, 1]
    chain = _chain(tokens, 1, 2, salt=b"")
    head, other = kv.allocator.allocate(2)
    kv.allocator.register(head, chain[0])  # the prefix's first page is already cached here...
    kv.allocator.register(other, b"other content")
    kv.allocator.free([head, other])  # ...and is the oldest cached page, the first to be evicted
    keys = torch.ones(1, 2, 1, 1, 1, dtype=torch.float64)
    assert import_pages(kv, pool, PageExport(1, chain, keys, -keys)) == 1  # only the second page was new
    match = kv.find_cached_prefix(tokens)
    assert match.page_ids[0] == head and len(match.page_ids) == 2, "the imported prefix is not found whole"
    assert kv.allocator.lookup(b"other content") is None  # room was made from another cached page
    kv.check_integrity([busy])


def test_an_import_that_does_not_fit_without_evicting_its_own_head_is_refused():
    kv = KVCacheManager(2, 1)
    pool = _tiny_pool(2, 1)
    busy = _seq("busy", [9, 9])
    assert kv.try_reserve(busy, 1)
    chain = _chain([0, 1], 1, 2, salt=b"")
    (head,) = kv.allocator.allocate(1)
    kv.allocator.register(head, chain[0])
    kv.allocator.free([head])
    keys = torch.ones(1, 2, 1, 1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="pages"):
        import_pages(kv, pool, PageExport(1, chain, keys, -keys))
    assert kv.allocator.lookup(chain[0]) == head and kv.allocator.is_evictable(head)
    assert kv.num_free_pages == 1 and kv.allocator.num_cached_pages == 1
    kv.check_integrity([busy])
