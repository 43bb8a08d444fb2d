"""PageAllocator + KVCacheManager with prefix caching, driven the way the scheduler and engine drive them.

A hypothesis state machine admits requests whose prompts share prefixes (a tiny vocabulary, so pages
repeat) from two cache groups (salts), computes them chunk by chunk, samples tokens, preempts and re-admits
them, finishes them, and lets "raw holders" (other users of the allocator) allocate, share, free and import
pages, forcing evictions. A reference model tracks every page's owners, its registered hash and the LRU order
of cached free pages; after every step the pool must agree with it through its public API. The test plays the
scheduler's part: it sets how much of a sequence is computed, as Scheduler does, and the manager may not.

The K/V a page holds is simulated in a real (tiny, CPU) KVPool: slot s of a page holds a number naming
the whole context the model saw up to that position (and the cache group that computed it), so serving stale,
foreign or another group's content from the prefix cache shows up as a mismatch, whatever the bookkeeping
claims. Every page_hash call is counted: each sequence hashes each of its pages once in its life.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from page_pool_fixtures import SALT, PageContents, chain_hashes, count_page_hashes, make_seq

from gpu_runtime.kv_cache.manager import KVCacheManager, PrefixMatch
from gpu_runtime.kv_cache.page_allocator import OutOfPagesError
from gpu_runtime.kv_cache.transfer import PageExport, export_pages, import_pages
from gpu_runtime.sequence import Sequence

VOCAB = 3  # so prompts, and the pages they fill, repeat often
MAX_SEQS = 5
NUM_RAW_HOLDERS = 3

tokens_st = st.lists(st.integers(0, VOCAB - 1), max_size=6)
prefix_st = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=10)
cache_salt_st = st.sampled_from(["", "", "tenant-b"])  # two cache groups, the default one more often
HISTORY = 4  # the last few conversations a new request may continue


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
        self.hash_tokens: dict[bytes, tuple[str, tuple[int, ...]]] = {}  # every hash seen -> (salt, tokens)
        self.duplicates: set[tuple[str, int]] = set()  # (request, page index) committed while cached elsewhere
        self.released_hashes: dict[str, list[bytes]] = {}  # preempted request -> the page hashes it had
        self.query_tokens = 0
        self.hit_tokens = 0
        # Every sequence ever made, and the pages hashed for lookups by content (export, import): with the
        # sequences' own hashes, all the page_hash calls there may be.
        self.created: list[Sequence] = []
        self.lookup_hashes = 0
        self._patch = pytest.MonkeyPatch()
        self.hash_calls = count_page_hashes(self._patch)

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
                (
                    s.request_id,
                    list(s.page_ids),
                    list(s.page_hashes),
                    s.num_registered_pages,
                    s.num_computed_tokens,
                    s.num_cached_tokens,
                )
                for s in self._all_seqs()
            ],
            [list(r) for r in self.raw],
        )

    def _base(self, index: int) -> list[int]:
        """A shared system prompt, or an earlier conversation (prompt + outputs) that a follow-up continues."""
        bases = self.prefixes + self.history[-HISTORY:]
        return list(bases[index % len(bases)])

    def chain_hashes(self, tokens: list[int], num_pages: int, cache_salt: str = "") -> list[bytes]:
        hashes = chain_hashes(tokens, self.P, num_pages, cache_salt=cache_salt)
        for i, h in enumerate(hashes):
            self.hash_tokens.setdefault(h, (cache_salt, tuple(tokens[: (i + 1) * self.P])))
        return hashes

    def _new_seq(self, prompt: list[int], max_tokens: int, cache_salt: str) -> Sequence:
        """A new request, its full pages hashed as Scheduler.add does."""
        seq = make_seq(f"r{self.next_request}", prompt, max_tokens, cache_salt=cache_salt)
        self.next_request += 1
        self.kv.hash_new_pages(seq)
        self.created.append(seq)
        self.waiting.append(seq)
        return seq

    def _lookup_by_content(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens` (default cache group), as LLMEngine.export_prefix finds it."""
        self.lookup_hashes += len(tokens) // self.P
        return self.kv.lookup(self.kv.hasher.hash_tokens(tokens))

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

    def _check_match(self, tokens: list[int], max_tokens: int | None, match: PrefixMatch, cache_salt: str = "") -> None:
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        # First what matters most: every page served holds exactly the K/V of these tokens, from this cache group.
        for i, page in enumerate(match.page_ids):
            assert self.content.read(page) == self.content.expected(tokens, i, cache_salt), (
                f"find_cached_prefix serves page {page} for page {i} of {tokens}, but it holds other K/V"
            )
        pages, hashes = [], []
        if self.caching:
            for h in self.chain_hashes(tokens, limit // self.P, cache_salt):
                if h not in self.page_of:
                    break
                pages.append(self.page_of[h])
                hashes.append(h)
        assert match.hashes == hashes and match.page_ids == pages, "find_cached_prefix: not the longest cached run"
        assert match.num_tokens(self.P) == len(pages) * self.P <= limit

    def _release(self, seq: Sequence) -> None:
        """As the scheduler releases a finished or preempted sequence: the manager frees its pages and keeps its
        hashes (they name content, not pages); the scheduler zeroes what it has computed."""
        refs = self._refs()
        pages, hashes, computed = list(seq.page_ids), list(seq.page_hashes), seq.num_computed_tokens
        self.history.append(seq.prompt_token_ids + seq.output_token_ids)
        self.kv.release(seq)
        assert (seq.page_ids, seq.num_registered_pages) == ([], 0)
        assert seq.page_hashes == hashes and seq.num_computed_tokens == computed, "release touched the scheduler's part"
        seq.num_computed_tokens = 0
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
        match = self.kv.find_cached_prefix(seq)
        assert self._snapshot() == before, "find_cached_prefix changed the pool or the sequence"
        self._check_match(tokens, seq.num_tokens - 1, match, seq.cache_salt)
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
        fresh = self.kv.num_pages_for(n) - len(match.page_ids)
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
        assert len(seq.page_ids) == max(self.kv.num_pages_for(n), len(match.page_ids))
        assert seq.page_hashes[: len(match.hashes)] == match.hashes and seq.num_registered_pages == len(match.hashes)
        assert seq.num_computed_tokens == 0, "try_admit set the scheduler's count"
        seq.num_computed_tokens = matched  # as the scheduler does at admission
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = matched
            if self.caching:
                self.query_tokens += seq.num_tokens
                self.hit_tokens += matched
        self.waiting.remove(seq)
        self.running.append(seq)
        self.released_hashes.pop(seq.request_id, None)
        return True

    def _commit(self, seq: Sequence) -> None:
        """What Scheduler.update_after_step does once a step computed `seq`'s tokens: hash the pages that
        filled, register the computed ones."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        have = seq.num_registered_pages
        num_full = seq.num_computed_tokens // self.P
        chain = self.chain_hashes(tokens, seq.num_tokens // self.P, seq.cache_salt)
        before = self._snapshot()
        self.kv.hash_new_pages(seq)
        self.kv.commit_full_pages(seq)
        if not self.caching:
            assert self._snapshot() == before, "hashed or registered pages with caching off"
            return
        assert seq.page_hashes == chain, "hash_new_pages: hashes are not the chain of the sequence's full pages"
        assert seq.num_registered_pages == num_full, "commit_full_pages did not register every computed page"
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
    @rule(
        base=st.integers(0, 7), suffix=tokens_st, max_tokens=st.integers(1, 6), cache_salt=cache_salt_st, data=st.data()
    )
    def new_request(self, base: int, suffix: list[int], max_tokens: int, cache_salt: str, data) -> None:
        prompt = (self._base(base) + suffix) or [0]
        self._admit(self._new_seq(prompt, max_tokens, cache_salt), data)

    @precondition(lambda self: len(self.running) + len(self.waiting) + 1 < MAX_SEQS)
    @rule(base=st.integers(0, 7), suffixes=st.lists(tokens_st, min_size=2, max_size=2), cache_salt=cache_salt_st)
    def burst_of_requests(self, base: int, suffixes: list[list[int]], cache_salt: str) -> None:
        """Two requests sharing a prefix queue up; the next engine step admits both, so both compute the
        same pages at once (the second copy of each page stays unregistered)."""
        for suffix in suffixes:
            self._new_seq((self._base(base) + suffix) or [0], 4, cache_salt)

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
        missing = self.kv.num_pages_for(target) - len(old)
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
            self.content.write_context(page, pos % self.P, tokens[: pos + 1], seq.cache_salt)
        seq.num_computed_tokens = target  # as Scheduler.update_after_step does
        self._commit(seq)  # as the engine does: update after the step, then append the sampled token
        if target == seq.num_tokens:  # the prompt (or last token) is done: the step samples a token
            seq.append_token(sampled, None)
            if seq.finish_reason is not None:
                self._release(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        computed_pages = list(seq.page_hashes[: seq.num_computed_tokens // self.P])
        self._release(seq)
        seq.num_preemptions += 1  # as the scheduler does: a recompute does not count its prompt again
        hashes = list(seq.page_hashes)
        self.kv.hash_new_pages(seq)  # requeued by Scheduler.add: only pages its last sampled token filled are new
        assert seq.page_hashes[: len(hashes)] == hashes, "preemption changed the sequence's page hashes"
        self.waiting.append(seq)
        self.released_hashes[seq.request_id] = computed_pages

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
        chain = self.chain_hashes(tokens, num_full)  # the default cache group's, as export_prefix hashes
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
            assert self._lookup_by_content(tokens).page_ids == chain_pages, "the imported prefix is not found"

    @rule(base=st.integers(0, 7), suffix=tokens_st)
    def export_prefix(self, base: int, suffix: list[int]) -> None:
        tokens = self._base(base) + suffix
        before = self._snapshot()
        match = self._lookup_by_content(tokens)
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
            self._patch.undo()
            self._drain_and_check()

    # -- invariants --------------------------------------------------------------------------------------------

    @invariant()
    def integrity_checks_pass(self) -> None:
        raw_holders = [make_seq(f"raw{i}") for i in range(NUM_RAW_HOLDERS)]
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
            cache_salt, tokens = self.hash_tokens[content_hash]
            expected = self.content.expected(tokens, len(tokens) // self.P - 1, cache_salt)
            assert self.content.read(page) == expected, f"cached page {page} lost the content its hash names"

    @invariant()
    def each_page_is_hashed_once(self) -> None:
        """A sequence hashes a page when it fills and never again: not while it waits, nor when it is
        re-admitted after preemption. Hashes only grow, so every call made is one of these."""
        assert self.hash_calls[0] == sum(len(s.page_hashes) for s in self.created) + self.lookup_hashes

    @invariant()
    def sequences_are_consistent(self) -> None:
        for seq in self.waiting:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            assert (seq.page_ids, seq.num_registered_pages, seq.num_computed_tokens) == ([], 0, 0)
            # Every full page is hashed while it waits, so admission only looks hashes up.
            num_hashed = seq.num_tokens // self.P if self.caching else 0
            assert seq.page_hashes == chain_hashes(tokens, self.P, num_hashed, cache_salt=seq.cache_salt)
        for seq in self.running:
            tokens = seq.prompt_token_ids + seq.output_token_ids
            computed = seq.num_computed_tokens
            assert 0 <= computed < seq.num_tokens
            assert len(set(seq.page_ids)) == len(seq.page_ids)
            assert len(seq.page_ids) >= self.kv.num_pages_for(computed)
            # Hashed up to the tokens it had when last computed (the token sampled since may fill a page).
            if self.caching:
                assert (seq.num_tokens - 1) // self.P <= len(seq.page_hashes) <= seq.num_tokens // self.P
            else:
                assert seq.page_hashes == []
            assert seq.page_hashes == chain_hashes(tokens, self.P, len(seq.page_hashes), cache_salt=seq.cache_salt)
            assert seq.num_registered_pages == (computed // self.P if self.caching else 0)
            for i, h in enumerate(seq.page_hashes[: seq.num_registered_pages]):
                page = seq.page_ids[i]
                if (seq.request_id, i) in self.duplicates:
                    assert self.allocator.lookup(h) != page and self.allocator.hash_of(page) is None
                else:
                    assert self.allocator.lookup(h) == page, f"{seq.request_id}'s page {i} is not found by its hash"
            # Everything the sequence computed is still in its pages: nobody wrote over them.
            for i in range(self.kv.num_pages_for(computed)):
                filled = min(self.P, computed - i * self.P)
                got = self.content.read(seq.page_ids[i])[:filled]
                expected = self.content.expected(tokens, i, seq.cache_salt)[:filled]
                assert got == expected, f"{seq.request_id}'s page {i} overwritten"


PrefixCachePoolMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPrefixCachePool = PrefixCachePoolMachine.TestCase
