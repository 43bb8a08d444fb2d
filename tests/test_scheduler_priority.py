"""Priority: interactive before batch in the queue, batch preempted first, and no deadlock under pressure."""

from __future__ import annotations

from conftest import kv_bytes_for

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.sequence import Priority

PARAMS = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)


def run_to_completion(engine: LLMEngine) -> list[str]:
    """Steps until idle; returns request ids in the order they produced their first token."""
    first_tokens: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.num_output_tokens == 1:
                first_tokens.append(out.request_id)
    return first_tokens


def test_waiting_interactive_requests_are_admitted_before_earlier_batch_ones(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2))
    for i in range(3):
        engine.add_request(f"batch{i}", [1, 2, 3 + i], PARAMS, priority=Priority.BATCH)
    for i in range(3):
        engine.add_request(f"chat{i}", [4, 5, 6 + i], PARAMS, priority=Priority.INTERACTIVE)
    order = run_to_completion(engine)
    assert order[:3] == ["chat0", "chat1", "chat2"]
    assert order[3:] == ["batch0", "batch1", "batch2"]


def test_an_interactive_request_displaces_running_batch_work_when_pages_run_out(llama_dir):
    # 30 pages of 4 tokens: the two batch requests (60 tokens each at the end) just fit together.
    config = EngineConfig(model=str(llama_dir), page_size=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 30))
    engine = LLMEngine(config)
    long_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine.add_request("batch0", list(range(1, 21)), long_params, priority=Priority.BATCH)
    engine.add_request("batch1", list(range(21, 41)), long_params, priority=Priority.BATCH)
    for _ in range(20):
        engine.step()
    assert engine.stats.num_preemptions == 0 and engine.kv.num_free_pages == 10
    # 60 prompt tokens need 15 pages: only preempting batch work makes room.
    engine.add_request("chat", list(range(50, 110)), PARAMS, priority=Priority.INTERACTIVE)
    steps = 0
    while not any(out.request_id == "chat" for out in engine.step()):
        steps += 1
    assert steps <= 1  # admitted at once, by preempting the most recently admitted batch request
    assert engine.stats.num_preemptions >= 1
    assert all(seq.priority == Priority.BATCH for seq in engine.scheduler.waiting)
    run_to_completion(engine)
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_victim_is_the_lowest_priority_most_recently_admitted(llama_dir):
    config = EngineConfig(model=str(llama_dir), page_size=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 30))
    engine = LLMEngine(config)
    grow = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    engine.add_request("chat", [1, 2, 3, 4], grow, priority=Priority.INTERACTIVE)
    engine.add_request("batch-early", [5, 6, 7, 8], grow, priority=Priority.BATCH)
    engine.add_request("batch-late", [9, 10, 11, 12], grow, priority=Priority.BATCH)
    preempted = []
    while engine.has_unfinished_requests() and not preempted:
        engine.step()
        preempted = [s.request_id for s in engine.scheduler.waiting]
    assert preempted == ["batch-late"]


def test_an_interactive_request_takes_a_running_batch_requests_slot_when_every_slot_is_taken(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=2))
    long_params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    engine.add_request("batch0", [1, 2, 3], long_params, priority=Priority.BATCH)
    engine.add_request("batch1", [4, 5, 6], long_params, priority=Priority.BATCH)
    engine.step()
    engine.step()
    engine.add_request("chat", [7, 8, 9], PARAMS, priority=Priority.INTERACTIVE)
    assert any(out.request_id == "chat" for out in engine.step()), "admitted at the very next step"
    assert engine.stats.num_preemptions == 1
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["batch1"]  # the latest admitted batch
    run_to_completion(engine)  # the displaced request resumes where it was, from a recompute
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_batch_requests_never_displace_each_other_for_a_slot(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1))
    engine.add_request("batch0", [1, 2, 3], PARAMS, priority=Priority.BATCH)
    engine.step()
    engine.add_request("batch1", [4, 5, 6], PARAMS, priority=Priority.BATCH)
    for _ in range(5):
        engine.step()
    assert engine.stats.num_preemptions == 0
    assert [seq.request_id for seq in engine.scheduler.waiting] == ["batch1"]
