"""Liveness from progress: a scheduler whose loop stops (SIGSTOP) stops serving its model at once, and comes back
on its own; a crashed frontend's requests are stopped on their schedulers and reported to its successor."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from daemon_harness import Daemon
from exposition import scrape, total
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS_TIMEOUT = 2.0  # the default, which the tests also show to be enough: a SIGSTOP is seen within 5 s
LONG = pb.SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0)


def _health(daemon: Daemon, service: str) -> int | None:
    try:
        stub = health_pb2_grpc.HealthStub(daemon.channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
    except grpc.RpcError:
        return None


def _failure(call_result) -> grpc.StatusCode | None:
    try:
        list(call_result)
    except grpc.RpcError as error:
        return error.code()
    return None


def test_a_stopped_scheduler_stops_serving_its_model_within_seconds_and_serves_again_when_it_resumes(tmp_path):
    config = tmp_path / "tokend.toml"
    # One slot, so that a second request waits in admission; a stall timeout the test never reaches, so that the
    # daemon does not replace the stopped scheduler while the test looks at it.
    config.write_text(f"max_num_seqs = 1\nstall_timeout = 300\nliveness_timeout = {LIVENESS_TIMEOUT}\n")
    with Daemon("--config", str(config)) as daemon, ThreadPoolExecutor(2) as pool:
        (scheduler,) = daemon.child_pids("tokend: scheduler")
        running = daemon.generation.Generate(pb.GenerateRequest(prompt="running", sampling=LONG), timeout=300)
        first = next(running)
        rest = pool.submit(list, running)
        queued = pool.submit(_failure, daemon.generation.Generate(pb.GenerateRequest(prompt="queued"), timeout=300))
        daemon.wait_for(lambda: daemon.metric("tokend:admission_queue_depth", priority="interactive") == 1, 30)
        os.kill(scheduler, signal.SIGSTOP)  # a hung engine: alive, but its loop makes no progress
        stopped_at = time.monotonic()
        try:
            daemon.wait_for(lambda: _health(daemon, TINY_RANDOM_MODEL_NAME) == NOT_SERVING, timeout=30)
            noticed_after = time.monotonic() - stopped_at
            assert _health(daemon, "") == NOT_SERVING and not daemon.gateway_is_serving()
            assert _health(daemon, "liveness") == SERVING  # a probe for Kubernetes' liveness: no reason to kill us
            (load,) = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
            assert not load.ready
            assert queued.result(timeout=30) == grpc.StatusCode.UNAVAILABLE  # failed, not left waiting
            asked_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                daemon.generate("new", max_tokens=2, timeout=60)
            refused_after = time.monotonic() - asked_at
            assert not rest.done(), "the running stream waits for its scheduler"
        finally:
            os.kill(scheduler, signal.SIGCONT)
        daemon.wait_for(lambda: _health(daemon, TINY_RANDOM_MODEL_NAME) == SERVING, timeout=30)
        chunks = [first, *rest.result(timeout=300)]
        (unresponsive,) = daemon.log_entries("scheduler_unresponsive")
        assert len(daemon.log_entries("scheduler_responsive")) == 1
        assert daemon.child_pids("tokend: scheduler") == [scheduler], "resumed, not replaced"
    assert noticed_after < 5.0
    assert LIVENESS_TIMEOUT <= unresponsive["seconds_since_report"] < noticed_after + 1.0
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and refused_after < LIVENESS_TIMEOUT
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 1900


def test_a_crashed_frontends_request_is_stopped_on_its_scheduler_and_reported_to_the_next_frontend():
    """A killed frontend is restarted and serves again, gRPC and the API port's /metrics (the engine's metrics
    again, the new frontend's counts); the request it was streaming is stopped on its scheduler and settled by its
    successor. (One daemon for what test_serve_lifecycle.py's killed-frontend test and test_metrics_api_port.py's
    restarted-frontend test each showed on a daemon of their own.)"""
    with Daemon() as daemon:
        (frontend,) = daemon.child_pids("tokend: frontend")
        request = pb.GenerateRequest(prompt="orphan", sampling=LONG, request_id="orphan-1")
        call = daemon.generation.Generate(request, timeout=120)
        seen = sum(len(next(call).token_ids) for _ in range(3))
        os.kill(frontend, signal.SIGKILL)
        assert _failure(call) is not None
        daemon.wait_for(lambda: daemon.child_pids("tokend: frontend") not in ([], [frontend]), timeout=60)
        settled = daemon.wait_for(lambda: _settled_orphan(daemon, "orphan-1"), timeout=60)
        daemon.wait_for(lambda: daemon.health_status() == SERVING, timeout=60)
        assert daemon.generate("after the crash", max_tokens=3, ignore_eos=True)[-1].finish_reason == "length"

        def engine_metrics() -> str | None:
            text = scrape(f"{daemon.http_url}/metrics")
            return text if total(text, "tokend:engine_metrics_up") == 1 else None

        text = daemon.wait_for(engine_metrics, timeout=60)
        assert total(text, "tokend:e2e_request_latency_seconds_count") == 1  # the new frontend's count
        # How it ended is told by the log alone (both lines were written before the ledger was settled).
        (aborted,) = daemon.log_entries("orphans_aborted")
        (orphan,) = daemon.log_entries("orphan_finished")
    assert aborted["process"] == "scheduler" and aborted["reason"] == "frontend_disconnected"
    assert orphan["process"] == "frontend" and orphan["finish_reason"] == "abort"
    # Stopped when its frontend went, not run to its end; and never fewer tokens than its client saw.
    assert seen <= settled["completion_tokens"] == orphan["completion_tokens"] < 1900


def _settled_orphan(daemon: Daemon, request_id: str) -> dict | None:
    """The ledger row of a request whose frontend died, once the next frontend wrote its scheduler's final counts
    (it marks the row interrupted when it starts, then settles it: updated_at moves past finished_at)."""
    with daemon.ledger() as ledger:
        rows = ledger.execute("SELECT * FROM usage WHERE request_id = ?", (request_id,)).fetchall()
    return next((dict(r) for r in rows if r["status"] == "interrupted" and r["updated_at"] > r["finished_at"]), None)
