"""The scheduler under random traffic, with no model: the promises a client relies on hold at every step.

A hypothesis state machine adds interactive and batch requests (prompts that share prefixes, from two cache
groups) to a scheduler over a small page pool, steps it as the engine would (fake_step), aborts requests, and
now and then stops the arrivals and steps until everything has finished. A tiny real KVPool holds, in each slot,
an id naming the context (and cache group) that computed it, so a step that would read another request's,
another group's or stale K/V shows up, whatever the bookkeeping claims.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from page_pool_fixtures import PageContents, count_page_hashes, fake_step, make_scheduler, make_seq

from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.kv_cache.manager import held_pages
from gpu_runtime.scheduler import SchedulerOutput
from gpu_runtime.sequence import Sequence, SequenceStatus

VOCAB = 3  # so prompts, and the pages they fill, repeat often
MAX_LIVE = 8  # unfinished requests at once
priority_st = st.sampled_from([Priority.INTERACTIVE, Priority.BATCH])
cache_salt_st = st.sampled_from(["", "", "tenant-b"])


def _key(seq: Sequence) -> tuple[int, int]:
    """The preemption order: the largest key is the first victim."""
    return (seq.priority, seq.admission_order)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_pages=st.integers(3, 24),
        page_size=st.sampled_from([1, 2, 4]),
        max_num_seqs=st.sampled_from([1, 1, 2, 2, 3, 4]),
        spare_tokens=st.sampled_from([0, 1, 2, 3, 5, 8, 16]),  # budget beyond one token per sequence
        chunked=st.booleans(),
        scheduling=st.sampled_from(["continuous", "continuous", "static"]),
        caching=st.sampled_from([True, True, False]),
        prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=16), min_size=1, max_size=3),
        # A model whose every layer slides: pages behind the window go back as sequences move on.
        window=st.sampled_from([None, None, None, 1, 2, 3, 5, 8]),
    )
    def setup(self, num_pages, page_size, max_num_seqs, spare_tokens, chunked, scheduling, caching, prefixes, window):
        self.scheduler = make_scheduler(
            num_pages,
            page_size,
            caching,
            window=window,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + spare_tokens,
            enable_chunked_prefill=chunked,
            scheduling=scheduling,
        )
        self.config = self.scheduler.config
        self.kv = self.scheduler.kv
        self.P = page_size
        self.static = scheduling == "static"
        self.prefixes = prefixes
        self.content = PageContents(num_pages, page_size)
        self.created: list[Sequence] = []
        self.sampled: dict[str, list[int]] = {}  # every token fake_step gave each request, in order
        self.first_cached: dict[str, int] = {}  # num_cached_tokens at a request's first admission
        self.history: list[list[int]] = []
        self.num_steps = 0
        self._patch = pytest.MonkeyPatch()
        self.hash_calls = count_page_hashes(self._patch)

    # -- helpers -------------------------------------------------------------------------------------------

    @property
    def unfinished(self) -> list[Sequence]:
        return self.scheduler.running + self.scheduler.waiting

    def _token_of(self, seq: Sequence) -> int:
        return (self.num_steps + len(seq.output_token_ids)) % VOCAB

    def _check_schedule(self, out: SchedulerOutput, before: dict) -> None:
        """What one schedule() promises, given the state just before it."""
        config, running = self.config, self.scheduler.running
        work = [(seq, 1) for seq in out.decodes] + [(w.seq, w.num_new_tokens) for w in out.prefills]
        seqs = [seq for seq, _ in work]
        assert len(set(seqs)) == len(seqs), "a sequence is scheduled twice in one step"
        assert all(seq.status is SequenceStatus.RUNNING and seq in running for seq in seqs)
        assert len(running) <= config.max_num_seqs
        if self.static:
            assert len(running) + len(self.scheduler.held) <= config.max_num_seqs, "a static batch grew past its slots"
        for seq, num_new in work:
            assert 1 <= num_new <= seq.num_uncomputed_tokens
            assert len(seq.page_ids) >= self.kv.num_pages_for(seq.num_computed_tokens + num_new), "no page to write"
        # Decodes first: every stream that was decoding gets its token, unless it lost its pages.
        for seq in before["decoding"]:
            assert seq in out.decodes or seq in out.preempted, f"{seq.request_id}'s decode was skipped"
        # The token budget; padding rows (static only) are not part of it.
        tokens = len(out.decodes) + sum(w.num_new_tokens for w in out.prefills)
        if self.static:
            assert out.padding == before["held"], "a finished member of the batch lost its row"
            assert not (out.prefills and before["running"]), "a static batch admitted a request while it ran"
        elif config.enable_chunked_prefill:
            assert not out.padding and out.num_tokens == tokens <= config.max_num_batched_tokens
        else:
            # Unchunked, a prompt larger than the budget runs whole as the step's only prefill.
            assert tokens <= config.max_num_batched_tokens or len(out.prefills) == 1
        if not config.enable_chunked_prefill or self.static:
            for w in out.prefills:
                assert w.num_new_tokens == w.seq.num_uncomputed_tokens, "an unchunked prompt was split"
        # A victim is the least urgent, most recently admitted: everything that ran before and still runs comes
        # before it. (A victim may be re-admitted in the same step, from its cached pages, if what displaced it
        # left room; it then runs under a new admission.)
        keys = before["keys"]
        for victim in out.preempted:
            assert victim.num_preemptions > before["preemptions"][victim]
            if victim.status is SequenceStatus.WAITING:
                assert not victim.page_ids and victim.num_computed_tokens == 0
            for seq in running:
                if seq in keys and seq not in out.preempted:
                    assert keys[seq] < keys[victim], f"{victim.request_id} was preempted before {seq.request_id}"
        self._check_interactive_is_not_left_behind_batch_work(out, tokens)

    def _check_interactive_is_not_left_behind_batch_work(self, out: SchedulerOutput, tokens: int) -> None:
        """When the head of the queue is interactive and every slot is taken, a running batch request gives
        up its slot (and its pages, as many as the head needs). So after any step, an interactive request
        waits beside running batch work only for token budget, never for a slot or pages (static batches
        never displace anyone)."""
        waiting, running, config = self.scheduler.waiting, self.scheduler.running, self.config
        if self.static or not waiting or waiting[0].priority != Priority.INTERACTIVE:
            return
        if not any(seq.priority == Priority.BATCH for seq in running):
            return
        head = waiting[0]
        assert len(running) < config.max_num_seqs, f"{head.request_id} waits for a slot a batch request holds"
        if out.preempted:
            # Either pages ran out for the running batch (nothing is admitted this step), or a batch request
            # already gave way to this head, which then lacked the budget to start.
            return
        left = config.max_num_batched_tokens - tokens
        remaining = head.num_tokens - self.kv.find_cached_prefix(head).num_tokens(self.P)
        if config.enable_chunked_prefill:
            assert left <= 0, f"{head.request_id} waits with {left} tokens of budget left"
        else:
            assert out.prefills and remaining > left, f"{head.request_id} waits with {left} tokens of budget left"

    def _compute(self, out: SchedulerOutput) -> None:
        """The forward: it reads the K/V of every computed token it sees (with a window, those of the pages it did not
        give back) and writes that of the scheduled ones."""
        work = [(seq, 1) for seq in out.decodes] + [(w.seq, w.num_new_tokens) for w in out.prefills]
        for seq, num_new in work:
            tokens = seq.token_ids_range(0, seq.num_tokens)
            for i in range(seq.num_released_pages, self.kv.num_pages_for(seq.num_computed_tokens)):
                filled = min(self.P, seq.num_computed_tokens - i * self.P)
                got = self.content.read(seq.page_ids[i])[:filled]
                expected = self.content.expected(tokens, i, seq.cache_salt)[:filled]
                assert got == expected, f"{seq.request_id} would read foreign or stale K/V from page {i}"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                page = seq.page_ids[pos // self.P]
                assert self.kv.allocator.hash_of(page) is None, f"{seq.request_id} writes into cached page {page}"
                self.content.write_context(page, pos % self.P, tokens[: pos + 1], seq.cache_salt)

    def _step(self) -> None:
        scheduler = self.scheduler
        before = {
            "decoding": [seq for seq in scheduler.running if seq.num_uncomputed_tokens == 1],
            "running": list(scheduler.running),
            "held": list(scheduler.held),
            "keys": {seq: _key(seq) for seq in scheduler.running},
            "preemptions": {seq: seq.num_preemptions for seq in scheduler.running},
        }
        out = scheduler.schedule()
        self._check_schedule(out, before)
        for w in out.prefills:
            if w.seq.num_preemptions == 0 and w.seq.request_id not in self.first_cached:
                self.first_cached[w.seq.request_id] = w.seq.num_computed_tokens
                assert w.seq.num_cached_tokens == w.seq.num_computed_tokens
        self._compute(out)
        for seq in fake_step(scheduler, out, self._token_of):
            self.sampled[seq.request_id].append(seq.output_token_ids[-1])
            if seq.status is SequenceStatus.FINISHED:
                assert seq.finish_reason is FinishReason.LENGTH
                assert len(seq.output_token_ids) == seq.params.max_tokens
                self.history.append(seq.token_ids_range(0, seq.num_tokens))
        self.num_steps += 1

    # -- rules: each is what happens between two steps of the engine's loop, then the next step ---------------

    @rule(count=st.integers(0, 3), data=st.data())
    def requests_arrive(self, count: int, data) -> None:
        """Some requests (or none) arrive: each continues a shared system prompt or an earlier conversation."""
        for _ in range(min(count, MAX_LIVE - len(self.unfinished))):
            self._add_request(data.draw(priority_st, label="priority"), data)
        self._step()

    @precondition(lambda self: any(seq.priority == Priority.BATCH for seq in self.scheduler.running))
    @rule(data=st.data())
    def interactive_request_arrives_during_batch_work(self, data) -> None:
        """The case priority is for: when batch work holds every slot, this step must make room for it."""
        self._add_request(Priority.INTERACTIVE, data)
        self._step()

    @precondition(lambda self: self.unfinished)
    @rule(data=st.data())
    def abort(self, data) -> None:
        """The client went away: running or waiting, the request leaves and its pages come back."""
        seq = data.draw(st.sampled_from(self.unfinished), label="aborted")
        self.scheduler.finish(seq, FinishReason.ABORT)
        assert seq.status is SequenceStatus.FINISHED and seq not in self.unfinished
        assert seq.page_ids == [] or seq in self.scheduler.held
        self._step()

    def _add_request(self, priority: Priority, data) -> None:
        """A request that fits the pool with its max_tokens, as the engine checks."""
        capacity = self.kv.num_pages * self.P
        base = data.draw(st.sampled_from(self.prefixes + self.history[-4:]), label="base")
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=10), label="suffix")
        prompt = (base + suffix)[: capacity - 1] or [0]
        longest = capacity - len(prompt)  # at least 1
        # Hypothesis favours the first choice: a request that lives several steps, so work piles up.
        max_tokens = data.draw(st.sampled_from([n for n in (8, 2, 16, 4, 1) if n <= longest]), label="max_tokens")
        cache_salt = data.draw(cache_salt_st, label="cache_salt")
        seq = make_seq(f"r{len(self.created)}", prompt, max_tokens, priority=priority, cache_salt=cache_salt)
        assert self.kv.fits_pool(seq.num_tokens + max_tokens, max_chunk=seq.num_tokens)
        self.created.append(seq)
        self.sampled[seq.request_id] = []
        self.scheduler.add(seq)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(now=st.sampled_from(range(4)))
    def stop_arrivals_and_drain(self, now: int) -> None:
        """Now and then the arrivals stop: every request finishes within a bound set by the requests alone,
        and every page comes back.

        While an interactive request runs, the most urgent, earliest admitted one is never preempted (a victim
        is the largest (priority, admission) key, and alone it fits the pool) and advances every step, so the
        interactive work takes at most S_I steps plus, each time none of it runs, the steps batch work needs
        to give up its slots, pages and budget (at most max_num_seqs + S_B + 1); then batch work drains the
        same way in S_B steps. S is the sum of prompt + max_tokens over the requests; a static batch ends with
        at least one request finished, after at most max(max_tokens) + 1 steps.
        """
        if now != 3:
            self._step()  # most of the time, the engine just steps
            return
        live = self.unfinished
        total = sum(seq.num_prompt_tokens + seq.params.max_tokens for seq in live)
        bound = total + (len(live) + 1) * (self.config.max_num_seqs + total + 1)
        steps = 0
        while self.scheduler.has_unfinished():
            assert steps < bound, f"requests still unfinished after {bound} steps: starved"
            self._step()
            steps += 1
            self.check_pages()
            self.check_requests()
        assert not self.scheduler.held
        assert self.kv.num_free_pages == self.kv.num_pages, "pages leaked"
        self.kv.check_integrity([])
        for seq in self.created:
            assert seq.status is SequenceStatus.FINISHED
            if seq.finish_reason is FinishReason.LENGTH:
                assert len(seq.output_token_ids) == seq.params.max_tokens

    def teardown(self) -> None:
        if hasattr(self, "scheduler"):
            self._patch.undo()

    # -- invariants ----------------------------------------------------------------------------------------

    @invariant()
    def check_pages(self) -> None:
        """No page leaked, none owned twice except a registered prefix page both requests share."""
        scheduler = self.scheduler
        holders = scheduler.running + scheduler.held
        self.kv.check_integrity(holders + scheduler.waiting)
        owners = Counter(page for seq in holders for page in held_pages(seq))
        assert self.kv.num_used_pages == len(owners)
        assert self.kv.num_free_pages + self.kv.num_used_pages == self.kv.num_pages
        for seq in holders:
            for index in range(seq.num_released_pages, len(seq.page_ids)):  # those behind a window are given back
                page = seq.page_ids[index]
                if owners[page] > 1:
                    assert index < seq.num_registered_pages and self.kv.allocator.hash_of(page) is not None, (
                        f"{seq.request_id} shares page {page}, which is not a cached prefix page"
                    )
        for seq in scheduler.waiting:
            assert (seq.page_ids, seq.num_computed_tokens) == ([], 0), f"waiting {seq.request_id} holds pages"

    @invariant()
    def check_requests(self) -> None:
        scheduler = self.scheduler
        assert all(seq.status is SequenceStatus.RUNNING for seq in scheduler.running)
        assert all(seq.status is SequenceStatus.WAITING for seq in scheduler.waiting)
        assert all(seq.status is SequenceStatus.FINISHED for seq in scheduler.held)
        keys = [seq.queue_key for seq in scheduler.waiting]
        assert keys == sorted(keys), "the waiting queue is out of priority and arrival order"
        for seq in self.created:
            # Every token sampled reached the request once, in order, across preemptions.
            assert seq.output_token_ids == self.sampled[seq.request_id]
            if seq.request_id in self.first_cached:
                assert seq.num_cached_tokens == self.first_cached[seq.request_id]
        # Each request hashes each of its pages once in its life, however long it waits or often it is preempted.
        assert self.hash_calls[0] == sum(len(seq.page_hashes) for seq in self.created)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
