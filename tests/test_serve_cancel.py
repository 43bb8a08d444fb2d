"""Cancelled, timed-out and aborted streams: the scheduler drops them at once and frees their pages."""

from __future__ import annotations

import grpc
import pytest
from daemon_harness import Daemon

from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

LONG = pb.SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0)


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def _idle(daemon: Daemon) -> bool:
    return (
        daemon.metric("tokend:num_requests_running") == 0
        and daemon.metric("tokend:num_requests_waiting") == 0
        and daemon.metric("tokend:kv_cache_usage_perc") == 0
    )


def _busy(daemon: Daemon) -> bool:
    return daemon.metric("tokend:num_requests_running") > 0 and daemon.metric("tokend:kv_cache_usage_perc") > 0


def test_cancelling_a_stream_frees_its_sequence_and_pages_within_a_second(daemon):
    aborted_before = daemon.metric("tokend:request_success_total", finished_reason="abort")
    generated_before = daemon.metric("tokend:generation_tokens_total")
    call = daemon.generation.Generate(pb.GenerateRequest(prompt="Cancel me", sampling=LONG), timeout=120)
    received = sum(len(next(call).token_ids) for _ in range(5))
    daemon.wait_for(lambda: _busy(daemon), timeout=5)
    call.cancel()
    daemon.wait_for(lambda: _idle(daemon), timeout=1.0)
    # The cancelled request is counted, with what its scheduler really generated (at least what we saw).
    assert daemon.wait_for(
        lambda: daemon.metric("tokend:request_success_total", finished_reason="abort") == aborted_before + 1, timeout=2
    )
    assert daemon.metric("tokend:generation_tokens_total") - generated_before >= received


def test_a_passed_deadline_ends_the_stream_and_frees_it(daemon):
    with pytest.raises(grpc.RpcError) as caught:
        for _ in daemon.generation.Generate(pb.GenerateRequest(prompt="Too slow", sampling=LONG), timeout=0.3):
            pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    daemon.wait_for(lambda: _idle(daemon), timeout=1.0)


def test_abort_from_another_connection_ends_the_stream_with_finish_reason_abort(daemon):
    request = pb.GenerateRequest(prompt="Abort me", request_id="abort-me", sampling=LONG)
    call = daemon.generation.Generate(request, timeout=120)
    first = next(call)
    assert first.request_id == "abort-me"
    with grpc.insecure_channel(daemon.address) as other_connection:
        reply = pb_grpc.GenerationStub(other_connection).Abort(pb.AbortRequest(request_id="abort-me"), timeout=10)
    assert reply.aborted
    chunks = list(call)
    assert chunks[-1].finish_reason == "abort"
    assert 1 <= chunks[-1].usage.completion_tokens < LONG.max_tokens
    daemon.wait_for(lambda: _idle(daemon), timeout=1.0)


def test_many_cancelled_streams_leave_the_gauges_at_their_baseline(daemon):
    calls = [
        daemon.generation.Generate(pb.GenerateRequest(prompt=f"n{i}", sampling=LONG), timeout=120) for i in range(12)
    ]
    for call in calls:
        next(call)
    for call in calls:
        call.cancel()
    daemon.wait_for(lambda: _idle(daemon), timeout=1.0)
    assert daemon.generate("after", max_tokens=4, ignore_eos=True)[-1].finish_reason == "length"
