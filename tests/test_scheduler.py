"""The scheduler's policy, with no model: priority and preemption, chunked and unchunked prefill, static batches,
and prefix-cache hits, each step computed by fake_step (LLMEngine.step minus the forward)."""

from __future__ import annotations

import pytest
from page_pool_fixtures import count_page_hashes, fake_step, make_scheduler, make_seq, run_steps

from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.scheduler import PrefillWork, Scheduler, SchedulerOutput
from gpu_runtime.sequence import Sequence, SequenceStatus

BATCH, INTERACTIVE = Priority.BATCH, Priority.INTERACTIVE


@pytest.fixture
def page_hash_calls(monkeypatch) -> list[int]:
    return count_page_hashes(monkeypatch)


def add(scheduler: Scheduler, name: str, prompt: list[int], max_tokens: int = 30, **options) -> Sequence:
    seq = make_seq(name, prompt, max_tokens, **options)
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[str]]:
    """One step; returns its schedule and the requests that got a token, in order."""
    out = scheduler.schedule()
    return out, [seq.request_id for seq in fake_step(scheduler, out)]


def first_token_order(scheduler: Scheduler) -> list[str]:
    """Steps until idle; returns request ids in the order they produced their first token."""
    order = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        order += [seq.request_id for seq in fake_step(scheduler, out) if len(seq.output_token_ids) == 1]
    return order


def assert_all_pages_back(scheduler: Scheduler) -> None:
    assert not scheduler.has_unfinished() and not scheduler.held
    assert scheduler.kv.num_free_pages == scheduler.kv.num_pages
    scheduler.kv.check_integrity([])


# -- priority ---------------------------------------------------------------------------------------------------


def test_waiting_interactive_requests_are_admitted_before_earlier_batch_ones():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(scheduler, f"batch{i}", [1, 2, 3 + i], priority=BATCH)
    for i in range(3):
        add(scheduler, f"chat{i}", [4, 5, 6 + i], priority=INTERACTIVE)
    order = first_token_order(scheduler)
    assert order[:3] == ["chat0", "chat1", "chat2"]
    assert order[3:] == ["batch0", "batch1", "batch2"]


def test_an_interactive_request_displaces_running_batch_work_when_pages_run_out():
    # 30 pages of 4 tokens: the two batch requests (60 tokens each at the end) just fit together.
    scheduler = make_scheduler(num_pages=30, page_size=4)
    add(scheduler, "batch0", list(range(1, 21)), 40, priority=BATCH)
    add(scheduler, "batch1", list(range(21, 41)), 40, priority=BATCH)
    for _ in range(20):
        step(scheduler)
    assert scheduler.num_preemptions == 0 and scheduler.kv.num_free_pages == 10
    # 60 prompt tokens need 15 pages: only preempting batch work makes room.
    add(scheduler, "chat", list(range(50, 110)), priority=INTERACTIVE)
    steps = 0
    while "chat" not in step(scheduler)[1]:
        steps += 1
    assert steps <= 1  # admitted at once, by preempting the most recently admitted batch request
    assert scheduler.num_preemptions >= 1
    assert all(seq.priority == BATCH for seq in scheduler.waiting)
    assert [seq.request_id for seq in scheduler.waiting] == ["batch1"]
    run_steps(scheduler)
    assert_all_pages_back(scheduler)


def test_victim_is_the_lowest_priority_most_recently_admitted():
    scheduler = make_scheduler(num_pages=30, page_size=4)
    add(scheduler, "chat", [1, 2, 3, 4], 100, priority=INTERACTIVE)
    add(scheduler, "batch-early", [5, 6, 7, 8], 100, priority=BATCH)
    add(scheduler, "batch-late", [9, 10, 11, 12], 100, priority=BATCH)
    preempted: list[str] = []
    while scheduler.has_unfinished() and not preempted:
        step(scheduler)
        preempted = [seq.request_id for seq in scheduler.waiting]
    assert preempted == ["batch-late"]


def test_an_interactive_request_takes_a_running_batch_requests_slot_when_every_slot_is_taken():
    scheduler = make_scheduler(num_pages=128, page_size=4, max_num_seqs=2)
    add(scheduler, "batch0", [1, 2, 3], 200, priority=BATCH)
    add(scheduler, "batch1", [4, 5, 6], 200, priority=BATCH)
    step(scheduler)
    step(scheduler)
    add(scheduler, "chat", [7, 8, 9], priority=INTERACTIVE)
    assert "chat" in step(scheduler)[1], "admitted at the very next step"
    assert scheduler.num_preemptions == 1
    assert [seq.request_id for seq in scheduler.waiting] == ["batch1"]  # the latest admitted batch
    run_steps(scheduler)  # the displaced request resumes where it was, from a recompute
    assert_all_pages_back(scheduler)


def test_batch_requests_never_displace_each_other_for_a_slot():
    scheduler = make_scheduler(max_num_seqs=1)
    add(scheduler, "batch0", [1, 2, 3], priority=BATCH)
    step(scheduler)
    add(scheduler, "batch1", [4, 5, 6], priority=BATCH)
    for _ in range(5):
        step(scheduler)
    assert scheduler.num_preemptions == 0
    assert [seq.request_id for seq in scheduler.waiting] == ["batch1"]


# -- chunked and unchunked prefill -------------------------------------------------------------------------------


def _streams_then_a_long_prompt(enable_chunked_prefill: bool) -> tuple[Scheduler, list[Sequence]]:
    """Four streams decoding in a batch of 32 tokens a step, then two 100-token prompts arrive."""
    scheduler = make_scheduler(
        num_pages=256, max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=enable_chunked_prefill
    )
    streams = [add(scheduler, f"stream{i}", [i + 1, 2, 3], 40) for i in range(4)]
    step(scheduler)
    add(scheduler, "long", list(range(100, 200)))
    add(scheduler, "long2", list(range(200, 300)))
    return scheduler, streams


def test_chunked_prefill_splits_a_long_prompt_under_the_budget_while_decodes_keep_running():
    scheduler, streams = _streams_then_a_long_prompt(enable_chunked_prefill=True)
    chunks = []
    for _ in range(10):
        out, sampled = step(scheduler)
        assert out.num_tokens <= 32
        assert out.decodes == streams, "every stream decodes at every step"
        chunks.append(out.tokens_of(next(w.seq for w in out.prefills if w.seq.request_id == "long")))
        if "long" in sampled:
            break
    assert chunks == [28, 28, 28, 16]  # the 28 tokens the four decodes leave, until the prompt is done
    assert sum(w.num_new_tokens for w in out.prefills if w.seq.request_id == "long2") == 32 - 4 - 16


def test_unchunked_prefill_runs_a_long_prompt_whole_as_the_steps_only_prefill():
    scheduler, streams = _streams_then_a_long_prompt(enable_chunked_prefill=False)
    out, sampled = step(scheduler)
    assert out.decodes == streams
    assert [(w.seq.request_id, w.num_new_tokens) for w in out.prefills] == [("long", 100)]  # over the budget
    assert "long" in sampled and scheduler.waiting[0].request_id == "long2"
    out, sampled = step(scheduler)
    assert [(w.seq.request_id, w.num_new_tokens) for w in out.prefills] == [("long2", 100)]
    assert len(out.decodes) == 5
    run_steps(scheduler)
    assert_all_pages_back(scheduler)


# -- static batching ----------------------------------------------------------------------------------------------


def run_recording(scheduler: Scheduler) -> tuple[dict[str, int], list[SchedulerOutput]]:
    """Steps until idle; returns the step each request finished at (1-based) and every step's schedule."""
    steps: list[SchedulerOutput] = []
    finished_at: dict[str, int] = {}
    while scheduler.has_unfinished():
        steps.append(scheduler.schedule())
        for seq in fake_step(scheduler, steps[-1]):
            if seq.status is SequenceStatus.FINISHED:
                finished_at[seq.request_id] = len(steps)
    return finished_at, steps


def test_a_static_batch_keeps_its_shape_until_its_longest_sequence_finishes():
    scheduler = make_scheduler(num_pages=128, max_num_seqs=3, scheduling="static")
    for name, n in (("short", 2), ("middle", 5), ("long", 9)):
        add(scheduler, name, list(range(1, 40)), n)
    add(scheduler, "next", [5, 6, 7], 3)  # the second batch
    finished_at, steps = run_recording(scheduler)

    # Tokens stream as they are made, so the short one's output ends early...
    assert finished_at["short"] < finished_at["middle"] < finished_at["long"]
    # ... but until the long one is done every step still computes three rows, the finished ones as padding,
    # and nothing new is admitted.
    first_batch_tail = steps[finished_at["short"] : finished_at["long"]]
    assert [step.num_seqs for step in first_batch_tail] == [3] * len(first_batch_tail)
    assert len(first_batch_tail[-1].padding) == 2  # short and middle, while long finishes
    assert finished_at["next"] > finished_at["long"]
    assert_all_pages_back(scheduler)  # the held pages came back with the batch


@pytest.mark.parametrize(
    ("scheduling", "padding_rows"), [("static", (17 - 3) + (17 - 8) + (17 - 12)), ("continuous", 0)]
)
def test_only_a_static_batch_pads_its_finished_sequences_until_the_longest_ends(scheduling, padding_rows):
    scheduler = make_scheduler(num_pages=128, max_num_seqs=4, scheduling=scheduling)
    for i, n in enumerate((3, 17, 8, 12)):
        add(scheduler, str(i), list(range(1 + i, 30 + 7 * i)), n)
    _, steps = run_recording(scheduler)
    assert sum(len(step.padding) for step in steps) == padding_rows


def test_static_scheduling_admits_no_one_while_a_batch_runs_even_with_free_slots():
    scheduler = make_scheduler(max_num_seqs=4, scheduling="static")
    first = [add(scheduler, "a", [1, 2, 3], 5), add(scheduler, "b", [4, 5, 6], 2)]
    step(scheduler)
    late = add(scheduler, "c", [7, 8, 9], 2)
    while scheduler.running:
        out, _ = step(scheduler)
        assert not out.prefills and late.status is SequenceStatus.WAITING
    assert all(seq.status is SequenceStatus.FINISHED for seq in first)
    out, sampled = step(scheduler)  # the batch drained: the next one is admitted at once
    assert [w.seq for w in out.prefills] == [late] and sampled == ["c"]
    run_steps(scheduler)
    assert_all_pages_back(scheduler)


# -- the prefix cache, seen from the scheduler -------------------------------------------------------------------


def test_a_prefix_hit_is_counted_once_not_again_when_a_preempted_request_finds_its_own_pages(page_hash_calls):
    scheduler = make_scheduler(num_pages=64, page_size=4, max_num_seqs=1)
    prefix = list(range(10))
    warm = add(scheduler, "warm", prefix, 2)
    run_steps(scheduler)
    reused = add(scheduler, "reused", prefix + [10, 11, 12, 13, 14], 10, priority=BATCH)
    out, _ = step(scheduler)
    assert out.prefills == [PrefillWork(reused, 15 - 8)]  # the two full pages of the prefix were cached
    assert reused.num_cached_tokens == 8
    step(scheduler)
    hashes = list(reused.page_hashes)
    chat = add(scheduler, "chat", [100, 101, 102], 2, priority=INTERACTIVE)
    out, _ = step(scheduler)  # the only slot goes to the interactive request
    assert out.preempted == [reused] and reused.num_computed_tokens == 0 and reused.page_ids == []
    assert reused.page_hashes == hashes, "preemption dropped the request's page hashes"
    recomputed = []
    while scheduler.has_unfinished():
        out, _ = step(scheduler)
        recomputed += [w.num_new_tokens for w in out.prefills if w.seq is reused]
    # Re-admitted from its own cached pages: its prompt and two outputs, 16 of its 17 tokens, are found again...
    assert recomputed == [1] and reused.num_preemptions == 1 and len(reused.output_token_ids) == 10
    # ...but what the client is told was cached stays what its prompt found at first.
    assert reused.num_cached_tokens == 8, "the recompute after preemption counted as a cache hit for the client"
    assert scheduler.kv.num_prefix_hit_tokens == 8
    # Every page of every request was hashed once, however often it was looked up.
    assert page_hash_calls[0] == sum(len(s.page_hashes) for s in (warm, reused, chat))
    assert_all_pages_back(scheduler)


def test_a_preempted_request_resumes_from_its_own_cached_pages():
    scheduler = make_scheduler(num_pages=64, page_size=4, max_num_seqs=1)
    victim = add(scheduler, "victim", list(range(13)), 10, priority=BATCH)
    for _ in range(3):
        step(scheduler)
    add(scheduler, "chat", [100, 101, 102], 2, priority=INTERACTIVE)
    out, _ = step(scheduler)
    assert out.preempted == [victim] and len(victim.output_token_ids) == 3
    for _ in range(5):
        out, _ = step(scheduler)
        if out.prefills:
            break
    # Re-admitted from the pages it computed, three full ones: only the fourth (its last computed token, and the
    # one sampled since) is recomputed.
    assert out.prefills == [PrefillWork(victim, 13 + 3 - 12)] and victim.num_computed_tokens == 13 + 3


def test_a_request_waiting_for_pages_hashes_its_prompt_once_not_at_every_step(page_hash_calls):
    scheduler = make_scheduler(num_pages=10, page_size=4)
    hog = add(scheduler, "hog", list(range(24)), 8)  # grows to 8 of the 10 pages
    step(scheduler)
    waiter = add(scheduler, "waiter", list(range(100, 120)), 4)  # needs 5 pages
    assert len(waiter.page_hashes) == 5
    waited = 0
    while waiter.status is SequenceStatus.WAITING:
        step(scheduler)
        waited += 1
    assert waited >= 7 and hog.status is SequenceStatus.FINISHED
    assert page_hash_calls[0] == len(hog.page_hashes) + len(waiter.page_hashes), "a page was hashed twice"
    run_steps(scheduler)
    assert page_hash_calls[0] == len(hog.page_hashes) + len(waiter.page_hashes)


def test_requests_share_cached_pages_only_within_their_cache_salt():
    scheduler = make_scheduler(num_pages=64, page_size=4)
    prompt = list(range(12))
    cached = {}
    for name, salt in (("a", "tenant-a"), ("b", "tenant-b"), ("c", "tenant-a"), ("d", ""), ("e", "tenant-b")):
        seq = add(scheduler, name, prompt, 2, cache_salt=salt)
        run_steps(scheduler)
        cached[name] = seq.num_cached_tokens
    assert cached == {"a": 0, "b": 0, "c": 8, "d": 0, "e": 8}
    assert_all_pages_back(scheduler)


def test_an_aborted_request_gives_its_pages_back_wherever_it_is():
    scheduler = make_scheduler(num_pages=8, page_size=4, max_num_seqs=1)
    running = add(scheduler, "running", list(range(10)), 10)
    waiting = add(scheduler, "waiting", list(range(20, 30)), 10)
    step(scheduler)
    scheduler.finish(waiting, FinishReason.ABORT)
    scheduler.finish(running, FinishReason.ABORT)
    assert (running.finish_reason, waiting.finish_reason) == (FinishReason.ABORT, FinishReason.ABORT)
    assert_all_pages_back(scheduler)
