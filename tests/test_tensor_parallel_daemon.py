"""`tokend serve --tensor-parallel-size 2` on the CPU: the scheduler (rank 0) starts rank 1 as its child and the
daemon serves streams. A rank killed (SIGKILL) or hung (SIGSTOP) mid-stream ends the group's streams UNAVAILABLE
within the stall timeout, and the daemon brings the whole group back, serving again with a new rank 1."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from daemon_harness import Daemon
from grpc_health.v1 import health_pb2

from tokend.v1 import tokend_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
LONG = pb.SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0)


def _failure(call) -> grpc.StatusCode | None:
    try:
        list(call)
    except grpc.RpcError as error:
        return error.code()
    return None


@pytest.mark.parametrize(
    ("how", "stall_timeout_s"),
    # A killed rank's socket closes at once: noticed long before the stall timeout. A stopped one answers nothing:
    # rank 0's collective times out after the stall timeout (the watchdog's), and then the group is restarted.
    [(signal.SIGKILL, 60.0), (signal.SIGSTOP, 8.0)],
    ids=["killed", "stopped"],
)
def test_two_ranks_serve_and_a_lost_rank_restarts_the_group(how, stall_timeout_s):
    with Daemon("--tensor-parallel-size", "2", "--stall-timeout", str(stall_timeout_s)) as daemon:
        (scheduler,) = daemon.child_pids("tokend: scheduler")
        (rank,) = daemon.child_pids("tokend: rank 1/2")
        assert daemon.generate("two ranks", max_tokens=6, ignore_eos=True)[-1].finish_reason == "length"

        stream = daemon.generation.Generate(pb.GenerateRequest(prompt="cut short", sampling=LONG), timeout=300)
        next(stream)  # decoding on both ranks
        os.kill(rank, how)
        lost_at = time.monotonic()
        try:
            assert _failure(stream) == grpc.StatusCode.UNAVAILABLE
            ended_after = time.monotonic() - lost_at

            def restarted() -> bool:
                schedulers = daemon.child_pids("tokend: scheduler")
                ranks = daemon.child_pids("tokend: rank 1/2")
                return schedulers not in ([], [scheduler]) and ranks not in ([], [rank])

            daemon.wait_for(lambda: restarted() and daemon.health_status() == SERVING, timeout=120)
            assert daemon.generate("again", max_tokens=4, ignore_eos=True)[-1].finish_reason == "length"
            assert daemon.log_entries("tensor_parallel_rank_lost") or daemon.log_entries("scheduler_stalled")
            assert rank not in daemon.child_pids("tokend: rank")  # the old rank went with its group
        finally:
            if how == signal.SIGSTOP and os.path.exists(f"/proc/{rank}"):
                os.kill(rank, signal.SIGKILL)
    print(f"the stream ended UNAVAILABLE {ended_after:.2f} s after rank 1 got {how.name}")
    assert ended_after < stall_timeout_s * 3  # a hang guard: within the stall timeout, plus a loaded machine's slack
