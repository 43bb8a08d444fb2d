"""Static scheduling, the benchmark baseline, batches as FasterTransformer or `transformers` generate do: a batch
is admitted whole and keeps its shape (finished sequences hold their slot and pages and are still computed)
until its last sequence finishes. Here, with a real model: the padding rows change no output. The policy itself
is in test_scheduler.py."""

from __future__ import annotations

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.scheduler import SchedulerOutput


def lengths(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def run_recording_steps(engine: LLMEngine) -> tuple[dict[str, list[int]], list[SchedulerOutput]]:
    """Steps until idle; returns each request's tokens and every step's plan."""
    steps: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        steps.append(schedule())
        return steps[-1]

    engine.scheduler.schedule = recording_schedule
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens, steps


def test_padding_rows_change_no_output(llama_dir):
    def run(scheduling: str) -> tuple[dict[str, list[int]], int]:
        engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, scheduling=scheduling))
        for i, n in enumerate((3, 17, 8, 12)):
            engine.add_request(str(i), list(range(1 + i, 30 + 7 * i)), lengths(n))
        tokens, steps = run_recording_steps(engine)
        return tokens, sum(len(step.padding) for step in steps)

    static_tokens, static_padding = run("static")
    continuous_tokens, continuous_padding = run("continuous")
    assert static_tokens == continuous_tokens
    assert (static_padding, continuous_padding) == ((17 - 3) + (17 - 8) + (17 - 12), 0)
