"""Static scheduling, the benchmark baseline, batches as FasterTransformer or `transformers` generate do: a batch
is admitted whole and keeps its shape (finished sequences hold their slot and pages and are still computed)
until its last sequence finishes."""

from __future__ import annotations

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.scheduler import SchedulerOutput


def lengths(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_recording_steps(engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, int], list[SchedulerOutput]]:
    """Steps until idle; returns each request's tokens, the step its stream ended at, and every step's plan."""
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        steps.append(schedule())
        return steps[-1]

    engine.scheduler.schedule = recording_schedule
    tokens: dict[str, list[int]] = {}
    finished_at: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finished_at[out.request_id] = len(steps)
    return tokens, finished_at, steps


def test_a_static_batch_keeps_its_shape_until_its_longest_sequence_finishes(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=3, scheduling="static"))
    for name, n in (("short", 2), ("middle", 5), ("long", 9)):
        engine.add_request(name, list(range(1, 40)), lengths(n))
    engine.add_request("next", [5, 6, 7], lengths(3))  # the second batch
    _, finished_at, steps = run_recording_steps(engine)

    # Tokens stream as they are made, so the short one's output ends early...
    assert finished_at["short"] < finished_at["middle"] < finished_at["long"]
    # ... but until the long one is done every step still computes three rows, the finished ones as padding,
    # and nothing new is admitted.
    first_batch_tail = steps[finished_at["short"] : finished_at["long"]]
    assert [step.num_seqs for step in first_batch_tail] == [3] * len(first_batch_tail)
    assert len(first_batch_tail[-1].padding) == 2  # short and middle, while long finishes
    assert finished_at["next"] > finished_at["long"]
    assert engine.kv.num_free_pages == engine.kv.num_pages  # the held pages came back with the batch


def test_padding_rows_change_no_output(llama_dir):
    def run(scheduling: str) -> tuple[dict[str, list[int]], int]:
        engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, scheduling=scheduling))
        for i, n in enumerate((3, 17, 8, 12)):
            engine.add_request(str(i), list(range(1 + i, 30 + 7 * i)), lengths(n))
        tokens, _, steps = run_recording_steps(engine)
        return tokens, sum(len(step.padding) for step in steps)

    static_tokens, static_padding = run("static")
    continuous_tokens, continuous_padding = run("continuous")
    assert static_tokens == continuous_tokens
    assert (static_padding, continuous_padding) == ((17 - 3) + (17 - 8) + (17 - 12), 0)
