"""A retired worker's drain in the scheduler process's loop, in process on a tiny engine: what still runs at its
drain timeout ends with final ABORT deltas carrying the counts so far, marked `migrate` only under on_drain_timeout
migrate; what ends before the timeout finishes as usual; either way the loop then stops by itself (the process
exits 0). With the frontend's side in test_request_session.py, this is what test_rollout.py's daemon case [abort]
showed (its [migrate] case stays there, end to end)."""

from __future__ import annotations

import queue
import threading

import pytest
import structlog

from common.lanes import DrainAction
from gpu_runtime.engine import LLMEngine
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import AddRequest, DrainWorker, FrontendHello, StepOutputs
from gpu_runtime.ipc.peer_auth import PeerAuth
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.worker.scheduler_loop import SchedulerLoop
from gpu_runtime.worker.spec import WorkerSpec

pytestmark = pytest.mark.engine


class Outbox:
    """The output thread's interface, keeping every message the loop sends."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def step_started(self, keepalive) -> None:
        pass

    def step_ended(self) -> None:
        pass

    def deltas(self, request_id: str) -> list:
        return [d for m in self.sent if isinstance(m, StepOutputs) for d in m.deltas if d.request_id == request_id]


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=4, kv_cache_bytes=32 << 20))


def _drain(engine, tmp_path, drain: DrainWorker, requests: dict[str, int]) -> Outbox:
    """Runs the loop on `requests` (request id -> max_tokens), drained by `drain` from its first step on, until it
    stops by itself; returns what it sent."""
    heartbeat = tmp_path / "heartbeat"
    heartbeat.touch()
    spec = WorkerSpec(worker_id="m/0", group="0", input_address="", output_address="", heartbeat_path=str(heartbeat),
                      secret_path="", engine=engine.config)  # fmt: skip
    inbox, outbox = queue.Queue(), Outbox()
    loop = SchedulerLoop(spec, engine, inbox, outbox, PeerAuth(b"k" * 32), structlog.get_logger())
    inbox.put(FrontendHello("f1", b""))
    for index, (request_id, max_tokens) in enumerate(requests.items()):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        inbox.put(AddRequest(request_id, [3 + index, 5, 7, 11], sampling, Priority.INTERACTIVE))
    inbox.put(drain)
    runner = threading.Thread(target=loop.run, daemon=True)
    runner.start()
    runner.join(timeout=120)
    if runner.is_alive():
        loop.stop()
        raise AssertionError(f"the drained loop did not stop by itself: {outbox.sent[-3:]}")
    assert not engine.has_unfinished_requests()
    return outbox


@pytest.mark.parametrize("action", [DrainAction.ABORT, DrainAction.MIGRATE])
def test_streams_past_the_drain_timeout_end_abort_with_their_counts_marked_migrate_as_configured(
    engine, tmp_path, action
):
    outbox = _drain(engine, tmp_path, DrainWorker(0.0, action), {"long-1": 100_000, "long-2": 100_000})
    for request_id in ("long-1", "long-2"):
        deltas = outbox.deltas(request_id)
        final = deltas[-1]
        assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [FinishReason.ABORT]
        tokens = [t for d in deltas for t in d.new_token_ids]
        assert 0 < final.num_output_tokens == len(tokens) < 100_000 and final.num_prompt_tokens == 4
        assert final.migrate is (action == DrainAction.MIGRATE)


def test_a_stream_that_ends_within_the_drain_timeout_finishes_and_then_the_loop_stops(engine, tmp_path):
    outbox = _drain(engine, tmp_path, DrainWorker(600.0, DrainAction.ABORT), {"short": 3})
    deltas = outbox.deltas("short")
    assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].num_output_tokens == 3
    assert not any(d.migrate for d in deltas)
