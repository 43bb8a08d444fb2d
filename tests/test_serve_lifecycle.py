"""The daemon as systemd runs it: crashed children restarted, SIGTERM drains, sd_notify, config errors."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from daemon_harness import ROOT, Daemon, free_port
from grpc_health.v1 import health_pb2

from tokend.v1 import tokend_pb2 as pb

SERVING = health_pb2.HealthCheckResponse.SERVING
LONG = pb.SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0)


def test_a_killed_scheduler_fails_its_streams_fast_and_comes_back():
    with Daemon() as daemon:
        (old_pid,) = daemon.child_pids("tokend: scheduler")
        call = daemon.generation.Generate(pb.GenerateRequest(prompt="mid-stream", sampling=LONG), timeout=60)
        next(call)
        os.kill(old_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - killed_at < 5.0
        assert daemon.health_status() != SERVING or daemon.child_pids("tokend: scheduler") != [old_pid]

        daemon.wait_for(lambda: daemon.health_status() == SERVING, timeout=60)
        (new_pid,) = daemon.child_pids("tokend: scheduler")
        assert new_pid != old_pid
        assert daemon.generate("after the crash", max_tokens=5, ignore_eos=True)[-1].finish_reason == "length"
        assert daemon.metric("tokend:scheduler_up") == 1


def test_sigterm_under_load_finishes_in_flight_streams_refuses_new_ones_and_exits_zero(tmp_path):
    config = tmp_path / "tokend.toml"
    config.write_text("drain_timeout = 120\nmax_num_seqs = 8\n")
    with Daemon("--config", str(config)) as daemon:
        session = daemon.session_pids()
        assert len(session) >= 3  # the daemon, its frontend and its scheduler
        # One stream runs long, so that the drain is certainly under way when the late request comes.
        lengths = [300] * 5 + [1500]
        requests = [
            pb.GenerateRequest(prompt=f"load {i}", sampling=pb.SamplingParams(max_tokens=n, ignore_eos=True))
            for i, n in enumerate(lengths)
        ]
        started = threading.Barrier(len(requests) + 1)

        def stream(request):
            call = daemon.generation.Generate(request, timeout=300)
            first = next(call)
            started.wait()
            return [first, *call]

        with ThreadPoolExecutor(len(requests)) as pool:
            futures = [pool.submit(stream, r) for r in requests]
            started.wait(timeout=30)
            daemon.process.send_signal(signal.SIGTERM)
            daemon.wait_for(lambda: daemon.health_status() != SERVING, timeout=5)
            with pytest.raises(grpc.RpcError) as caught:
                daemon.generate("too late", max_tokens=2)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            results = [future.result(timeout=180) for future in futures]
        assert all(chunks[-1].finish_reason == "length" for chunks in results)
        assert [chunks[-1].usage.completion_tokens for chunks in results] == lengths
        assert daemon.process.wait(timeout=180) == 0
        assert not [pid for pid in session if _alive(pid)], "every child is reaped"
        # A whole life of the daemon, start to drained exit, left only JSON records (uvicorn's own included).
        log_lines = daemon.log_path.read_text().splitlines()
        records = [json.loads(line) for line in log_lines]
        assert {"daemon", "frontend", "scheduler", "gateway"} <= {record["process"] for record in records}
        assert any(record.get("logger", "").startswith("uvicorn") for record in records)
        # No [[tenants]]: the daemon says loudly that anyone may use it.
        assert [r["level"] for r in records if r["event"] == "AUTHENTICATION_IS_OFF"] == ["warning"]


def test_a_drain_timeout_aborts_what_is_left_and_still_exits_zero():
    with Daemon("--drain-timeout", "0.5") as daemon:
        call = daemon.generation.Generate(pb.GenerateRequest(prompt="endless", sampling=LONG), timeout=60)
        next(call)
        daemon.process.send_signal(signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert daemon.process.wait(timeout=30) == 0


def test_admin_drain_stops_admission_while_in_flight_streams_finish_and_get_load_reports():
    with Daemon() as daemon:
        (load,) = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
        assert load.ready and load.pid == daemon.child_pids("tokend: scheduler")[0] and load.report_age_seconds < 1
        call = daemon.generation.Generate(
            pb.GenerateRequest(prompt="in flight", sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)),
            timeout=60,
        )
        next(call)
        assert daemon.admin.Drain(pb.DrainRequest(), timeout=10).in_flight == 1
        assert daemon.health_status() != SERVING
        with pytest.raises(grpc.RpcError) as caught:
            daemon.generate("refused", max_tokens=2)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert list(call)[-1].finish_reason == "length"
        reply = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10)
        assert reply.draining and reply.in_flight == 0


def test_systemd_hears_ready_watchdog_only_while_the_scheduler_loop_moves_and_stopping(tmp_path):
    notify_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(0.1)
    messages: list[tuple[float, str]] = []
    os.environ.update(NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="200000")
    try:
        with Daemon("--stall-timeout", "2") as daemon:
            (scheduler,) = daemon.child_pids("tokend: scheduler")
            _collect(listener, messages, seconds=1.0)
            os.kill(scheduler, signal.SIGSTOP)  # a hung engine: alive, but its loop makes no progress
            stopped_at = time.monotonic()
            _collect(listener, messages, seconds=4.0)
            daemon.wait_for(lambda: daemon.child_pids("tokend: scheduler") not in ([], [scheduler]), timeout=30)
            daemon.wait_for(lambda: daemon.health_status() == SERVING, timeout=60)
            _collect(listener, messages, seconds=1.0)
            daemon.process.send_signal(signal.SIGTERM)
            assert daemon.process.wait(timeout=30) == 0
            _collect(listener, messages, seconds=0.3)
    finally:
        del os.environ["NOTIFY_SOCKET"], os.environ["WATCHDOG_USEC"]
        listener.close()
    states = [text for _, text in messages]
    assert any(text.startswith("READY=1") for text in states)
    assert states[-1].startswith("STOPPING=1")
    pings = [at for at, text in messages if text == "WATCHDOG=1"]
    assert any(at < stopped_at for at in pings)
    # Silent from the moment the loop could be seen stalled (2 s) until it was replaced.
    assert not [at for at in pings if stopped_at + 2.4 < at < stopped_at + 3.0]
    assert any(at > stopped_at + 4.0 for at in pings), "pings resume once a new scheduler runs"


def _collect(listener: socket.socket, messages: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            messages.append((time.monotonic(), listener.recv(4096).decode()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs"),
        (["--model", "/no/such/dir"], "model"),
        (["--scheduling", "static", "--dtype", "float64"], "dtype"),
        (["--grpc-port", "70000"], "grpc_port"),
    ],
)
def test_a_bad_option_exits_78_naming_it(flags, key):
    result = _serve(*flags)
    assert result.returncode == 78
    assert key in result.stderr and "Traceback" not in result.stderr


def test_a_bad_config_file_exits_78_naming_the_key(tmp_path):
    config = tmp_path / "tokend.toml"
    config.write_text("max_num_seqs = 8\nmax_num_sequences = 8\n")
    result = _serve("--config", str(config))
    assert result.returncode == 78 and "max_num_sequences" in result.stderr
    config.write_text("max_num_seqs = 'many'\n")
    result = _serve("--config", str(config))
    assert result.returncode == 78 and "max_num_seqs" in result.stderr


def test_a_model_that_cannot_load_exits_78_naming_the_problem(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    result = _serve("--model", str(tmp_path), "--grpc-port", str(free_port()), "--metrics-port", "0", timeout=120)
    assert result.returncode == 78
    assert "engine_failed_to_start" in result.stderr and "gpt2" in result.stderr.lower()


def test_a_port_in_use_makes_the_daemon_exit_non_zero():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _serve("--grpc-port", str(port), "--metrics-port", str(free_port()), timeout=60)
    assert result.returncode != 0
    assert "grpc_port" in result.stderr


def _serve(*flags: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "daemon.cli", "serve", *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
