"""An out-of-memory error inside a step fails that step's requests only, with an error their clients read; the
others finish with the tokens they would have had, the page pool stays whole, and later steps are smaller."""

from __future__ import annotations

import queue
import threading

import pytest
import torch
from conftest import kv_bytes_for

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import AddRequest, FrontendHello, StepOutputs
from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.worker.scheduler_loop import SchedulerLoop
from gpu_runtime.worker.spec import WorkerSpec

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7, 8, 9, 10], "b": list(range(20, 40)), "c": list(range(50, 65)), "d": [3, 1, 4, 1, 5, 9, 2]}


class OutOfMemoryOnDemand:
    """Stands in for the runner's execute: raises what torch raises when the device runs out, while armed."""

    def __init__(self, execute):
        self.execute = execute
        self.failures_left = 0

    def __call__(self, inputs):
        if self.failures_left:
            self.failures_left -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.execute(inputs)


def _engine(llama_dir) -> tuple[LLMEngine, OutOfMemoryOnDemand]:
    config = EngineConfig(model=str(llama_dir), device="cpu", max_num_seqs=2, max_num_batched_tokens=64,
                          kv_cache_bytes=kv_bytes_for(llama_dir, 16, 32))  # fmt: skip
    engine = LLMEngine(config)
    fault = OutOfMemoryOnDemand(engine.runner.execute)
    engine.runner.execute = fault
    return engine, fault


def _drain(engine: LLMEngine, outputs: dict[str, list], reasons: dict[str, object]) -> None:
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason


def _reference(llama_dir) -> dict[str, list[int]]:
    """c and d as a fault-free engine generates them, admitted together as they are after the fault."""
    engine, _ = _engine(llama_dir)
    for request_id in ("c", "d"):
        engine.add_request(request_id, PROMPTS[request_id], GREEDY)
    outputs: dict[str, list] = {}
    _drain(engine, outputs, {})
    return outputs


def test_an_out_of_memory_step_fails_its_own_requests_and_the_others_finish_as_without_it(llama_dir):
    engine, fault = _engine(llama_dir)
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.step()  # a prefills, and decodes from here on
    engine.add_request("b", PROMPTS["b"], GREEDY)
    engine.add_request("c", PROMPTS["c"], GREEDY)  # waits: max_num_seqs is 2
    fault.failures_left = 1
    failed = engine.step()  # a's decode and b's prefill

    assert {d.request_id: d.finish_reason for d in failed} == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    assert all(d.error.startswith("out of memory on cpu in a step of 21 tokens; retry") for d in failed), failed
    assert all(d.retryable for d in failed)  # the frontend answers UNAVAILABLE: send it again
    assert engine.step_failure.failed_request_ids == ("a", "b")
    assert engine.scheduler.policy.max_tokens == engine.step_failure.token_budget == 32  # halved from 64
    assert engine.unfinished_request_ids() == ["c"]
    engine.check_integrity()  # a's and b's pages are back in the pool

    engine.add_request("d", PROMPTS["d"], GREEDY)
    outputs: dict[str, list] = {}
    reasons: dict[str, object] = {}
    _drain(engine, outputs, reasons)
    assert engine.step_failure is None
    assert reasons == {"c": FinishReason.LENGTH, "d": FinishReason.LENGTH}
    assert outputs == _reference(llama_dir)
    engine.check_integrity()
    assert engine.kv.num_free_pages == engine.kv.num_pages


def test_the_budget_halves_down_to_one_token_per_sequence_and_the_engine_keeps_serving(llama_dir):
    engine, fault = _engine(llama_dir)
    budgets = []
    for attempt in range(7):
        engine.add_request(f"r{attempt}", PROMPTS["a"], GREEDY)
        fault.failures_left = 1
        (delta,) = engine.step()
        assert delta.finish_reason is FinishReason.ERROR
        budgets.append(engine.step_failure.token_budget)
    assert budgets == [32, 16, 8, 4, 2, 2, 2]  # never below max_num_seqs decode tokens
    engine.add_request("after", PROMPTS["a"], GREEDY)
    outputs: dict[str, list] = {}
    reasons: dict[str, object] = {}
    _drain(engine, outputs, reasons)
    assert reasons == {"after": FinishReason.LENGTH} and len(outputs["after"]) == 8
    engine.check_integrity()


class _RecordingLog:
    def __init__(self):
        self.records: list[tuple[str, str, dict]] = []

    def bind(self, **_):
        return self

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((level, event, fields))


class _RecordingOutbox:
    def __init__(self):
        self.sent: list = []
        self._changed = threading.Condition()

    def send(self, message) -> None:
        with self._changed:
            self.sent.append(message)
            self._changed.notify_all()

    def wait_for_delta(self, request_id: str, timeout: float):
        """The first delta sent for `request_id`, waiting for the loop to send it."""
        with self._changed:
            found = self._changed.wait_for(lambda: self.deltas(request_id), timeout=timeout)
            assert found, self.sent
            return found[0]

    def deltas(self, request_id: str) -> list:
        return [d for m in self.sent if isinstance(m, StepOutputs) for d in m.deltas if d.request_id == request_id]

    def step_started(self, keepalive) -> None:  # the output thread's keep-alives: none in a recording
        pass

    def step_ended(self) -> None:
        pass


def test_the_scheduler_loop_sends_the_failure_and_logs_it(llama_dir, tmp_path):
    engine, fault = _engine(llama_dir)
    auth = PeerAuth(b"k" * 32)
    spec = WorkerSpec(worker_id="m/0", group="0", input_address="ipc://unused", output_address="ipc://unused",
                      heartbeat_path=str(tmp_path / "alive"), secret_path="unused", engine=EngineConfig())  # fmt: skip
    (tmp_path / "alive").touch()
    inbox, outbox, log = queue.Queue(), _RecordingOutbox(), _RecordingLog()
    loop = SchedulerLoop(spec, engine, inbox, outbox, auth, log)
    fault.failures_left = 1
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        inbox.put(FrontendHello("f1", auth.hello_proof("f1")))
        inbox.put(AddRequest("x", PROMPTS["b"], GREEDY, Priority.INTERACTIVE))
        delta = outbox.wait_for_delta("x", timeout=30)  # the loop logs the failure before it sends it
    finally:
        loop.stop()
        thread.join(timeout=10)
    assert delta.finish_reason is FinishReason.ERROR and delta.error.startswith("out of memory on cpu")
    assert len(outbox.deltas("x")) == 1
    (record,) = [fields for level, event, fields in log.records if event == "step_out_of_memory"]
    assert (record["failed_requests"], record["step_tokens"], record["max_num_batched_tokens"]) == (["x"], 20, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_an_out_of_memory_step_fails_alone_too(llama_dir):
    config = EngineConfig(model=str(llama_dir), device="cuda", max_num_seqs=2, max_num_batched_tokens=64,
                          kv_cache_bytes=16 << 20)  # fmt: skip
    engine = LLMEngine(config)
    fault = OutOfMemoryOnDemand(engine.runner.execute)
    engine.runner.execute = fault
    engine.add_request("a", PROMPTS["a"], GREEDY)
    engine.step()
    fault.failures_left = 1
    engine.add_request("b", PROMPTS["b"], GREEDY)
    engine.add_request("c", PROMPTS["c"], GREEDY)
    assert {d.request_id for d in engine.step()} == {"a", "b"}
    outputs: dict[str, list] = {}
    reasons: dict[str, object] = {}
    _drain(engine, outputs, reasons)
    assert reasons == {"c": FinishReason.LENGTH} and len(outputs["c"]) == 8
    engine.check_integrity()
