"""Metering against a real `tokend serve`: the ledger counts what was really generated, cancelled streams
included, agrees with Prometheus, and loses no finished request when the frontend is killed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import grpc
import pytest
from daemon_harness import ROOT, Daemon
from grpc_health.v1 import health_pb2

from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

TENANTS = ("acme", "globex", "initech")
MAX_ABORT_TOKENS = 10  # tokens a cancelled stream may be billed beyond what its client received


def _config(path: Path) -> Path:
    tables = [
        f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{hashlib.sha256(f"key-{name}".encode()).hexdigest()}"\n'
        f"admin = {'true' if name == 'acme' else 'false'}\n"
        for name in TENANTS
    ]
    path.write_text("\n".join(tables))
    return path


def _as(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer key-{tenant}"),)


def _rows(daemon: Daemon) -> dict[str, sqlite3.Row]:
    with contextlib.closing(sqlite3.connect(f"file:{daemon.state_dir}/usage.sqlite3?mode=ro", uri=True)) as db:
        db.row_factory = sqlite3.Row
        return {row["request_id"]: row for row in db.execute("SELECT * FROM usage")}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with Daemon("--config", str(_config(tmp_path_factory.mktemp("metering") / "tokend.toml"))) as running:
        yield running


def test_thirty_streams_of_three_tenants_a_third_cancelled_are_metered_exactly(daemon):
    async def run(stub, index: int) -> dict:
        tenant, cancel = TENANTS[index % 3], index % 3 == 0 or index % 5 == 0
        request = pb.GenerateRequest(
            prompt=f"metered {index}",
            request_id=f"m-{index}",
            sampling=pb.SamplingParams(max_tokens=150 + index, ignore_eos=True, temperature=0),
        )
        call = stub.Generate(request, metadata=_as(tenant), timeout=120)
        seen = {"request_id": request.request_id, "tenant": tenant, "cancelled": cancel, "received": 0}
        number = 0
        async for chunk in call:
            seen["received"] += len(chunk.token_ids)
            seen.setdefault("first_at", time.time())
            if cancel and number == 4:
                seen["cancelled_at"] = time.time()
                call.cancel()
                break
            number += 1
        return seen

    async def run_all() -> list[dict]:
        # One event loop reads all 30 streams: a cancelling client reads what arrived before it cancels.
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await asyncio.gather(*(run(stub, index) for index in range(30)))

    results = asyncio.run(run_all())
    assert sum(seen["cancelled"] for seen in results) >= 10
    daemon.wait_for(lambda: all(row["status"] != "running" for row in _rows(daemon).values()), timeout=10)
    rows = _rows(daemon)
    aborted_at = _aborted_at(daemon)
    for seen in results:
        row = rows[seen["request_id"]]
        assert row["tenant"] == seen["tenant"]
        if not seen["cancelled"]:
            assert row["status"] == "finished" and row["completion_tokens"] == seen["received"]
            continue
        assert row["status"] == "cancelled"
        # Billed beyond what the client read: only what its stream generated from the client's last read until
        # the scheduler dropped it (tokens in flight, then the abort latency), at the rate the stream ran.
        rate = seen["received"] / max(1e-3, seen["cancelled_at"] - seen["first_at"])
        window = aborted_at[seen["request_id"]] - seen["cancelled_at"]
        assert seen["received"] <= row["completion_tokens"] <= seen["received"] + rate * window + 3

    usage = json.loads(_usage_cli(daemon.state_dir, "--json"))["tenants"]
    for tenant in TENANTS:
        mine = [rows[seen["request_id"]] for seen in results if seen["tenant"] == tenant]
        assert usage[tenant]["requests"] == len(mine)
        assert usage[tenant]["completion_tokens"] == sum(row["completion_tokens"] for row in mine)
        assert usage[tenant]["cancelled"] == sum(row["status"] == "cancelled" for row in mine)
        # Prometheus counts the very same numbers.
        assert (
            daemon.metric("tokend:tenant_completion_tokens_total", tenant=tenant) == usage[tenant]["completion_tokens"]
        )
        assert daemon.metric("tokend:tenant_prompt_tokens_total", tenant=tenant) == usage[tenant]["prompt_tokens"]
        assert daemon.metric("tokend:tenant_requests_total", tenant=tenant) == usage[tenant]["requests"]
    reply = daemon.admin.GetUsage(pb.GetUsageRequest(), metadata=_as("acme"), timeout=10)
    assert {name: dict(completion_tokens=u.completion_tokens) for name, u in reply.tenants.items()} == {
        name: dict(completion_tokens=u["completion_tokens"]) for name, u in usage.items()
    }


def test_a_killed_frontend_loses_no_finished_record_and_marks_the_rest_interrupted(daemon):
    finished: dict[str, int] = {}
    lock = threading.Lock()

    def run(index: int) -> None:
        request = pb.GenerateRequest(
            prompt=f"crash {index}",
            request_id=f"k-{index}",
            sampling=pb.SamplingParams(max_tokens=20 + 120 * index, ignore_eos=True, temperature=0),
        )
        received = 0
        with contextlib.suppress(grpc.RpcError):
            for chunk in daemon.generation.Generate(request, metadata=_as("globex"), timeout=120):
                received += len(chunk.token_ids)
                if chunk.finish_reason:
                    with lock:
                        finished[request.request_id] = received

    with ThreadPoolExecutor(12) as pool:
        started = time.monotonic()
        futures = [pool.submit(run, index) for index in range(12)]
        # Killed once some have finished and the rest have been checkpointed at least once.
        daemon.wait_for(lambda: len(finished) >= 3 and time.monotonic() - started > 2.5, timeout=60)
        (frontend,) = daemon.child_pids("tokend: frontend")
        os.kill(frontend, signal.SIGKILL)
        for future in futures:
            future.result(timeout=120)
    assert 3 <= len(finished) < 12
    daemon.wait_for(lambda: daemon.health_status() == health_pb2.HealthCheckResponse.SERVING, timeout=60)
    rows = _rows(daemon)
    for request_id, received in finished.items():
        assert (rows[request_id]["status"], rows[request_id]["completion_tokens"]) == ("finished", received)
    unfinished = [rows[f"k-{i}"] for i in range(12) if f"k-{i}" not in finished]
    assert all(row["status"] == "interrupted" for row in unfinished)
    assert any(row["completion_tokens"] > 0 for row in unfinished), "checkpoints kept their counts so far"


def _aborted_at(daemon: Daemon) -> dict[str, float]:
    """When each request's scheduler dropped it, from its `request_aborted` log line."""
    return {
        entry["request_id"]: datetime.fromisoformat(entry["timestamp"]).timestamp()
        for entry in daemon.log_entries("request_aborted")
    }


def _usage_cli(state_dir: str, *flags: str) -> str:
    command = [sys.executable, "-m", "daemon.cli", "usage", "--state-dir", state_dir, *flags]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    return result.stdout
