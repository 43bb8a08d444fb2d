"""Priority through the engine: LLMEngine.add_request's priority reaches the scheduler, and the batch work an
interactive request displaces resumes with its outputs unchanged. The policy itself is in test_scheduler.py."""

from __future__ import annotations

from conftest import kv_bytes_for

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import RequestDelta

GREEDY_40 = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
GREEDY_30 = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
REQUESTS = {
    "batch0": (list(range(1, 21)), GREEDY_40, Priority.BATCH),
    "batch1": (list(range(21, 41)), GREEDY_40, Priority.BATCH),
    "chat": (list(range(50, 110)), GREEDY_30, Priority.INTERACTIVE),
}


def record(tokens: dict[str, list[int]], outputs: list[RequestDelta]) -> list[str]:
    for out in outputs:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [out.request_id for out in outputs]


def add(engine: LLMEngine, name: str) -> None:
    prompt, params, priority = REQUESTS[name]
    engine.add_request(name, prompt, params, priority=priority)


def test_batch_work_displaced_by_an_interactive_request_resumes_with_unchanged_outputs(llama_dir):
    reference = LLMEngine(EngineConfig(model=str(llama_dir)))
    expected: dict[str, list[int]] = {}
    for name in REQUESTS:
        add(reference, name)
    while reference.has_unfinished_requests():
        record(expected, reference.step())

    # 30 pages of 4 tokens: the two batch requests just fit together, the interactive one only by preempting one.
    engine = LLMEngine(EngineConfig(model=str(llama_dir), page_size=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 30)))
    tokens: dict[str, list[int]] = {}
    add(engine, "batch0")
    add(engine, "batch1")
    for _ in range(20):
        record(tokens, engine.step())
    add(engine, "chat")
    assert record(tokens, engine.step()) == ["batch0", "chat"]  # batch1 gave way at once
    assert engine.stats.num_preemptions == 1
    while engine.has_unfinished_requests():
        record(tokens, engine.step())
    assert tokens == expected
    assert engine.kv.num_free_pages == engine.kv.num_pages
