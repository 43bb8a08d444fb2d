"""Metering against a real `tokend serve`: the ledger counts what was really generated, cancelled streams
included, agrees with Prometheus, and loses no finished request when the frontend is killed."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest
from daemon_harness import ROOT, Daemon
from grpc_health.v1 import health_pb2

from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

TENANTS = ("acme", "globex", "initech")
USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cancelled")


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
    with daemon.ledger() as db:
        return {row["request_id"]: row for row in db.execute("SELECT * FROM usage")}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = _config(tmp_path_factory.mktemp("metering") / "tokend.toml")
    with Daemon("--config", str(config), "--tenant-metrics") as running:
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
        seen = {"request_id": request.request_id, "tenant": tenant, "cancelled": cancel, "received": 0,
                "max_tokens": request.sampling.max_tokens}  # fmt: skip
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
    aborted = _aborted(daemon)
    for seen in results:
        row = rows[seen["request_id"]]
        assert row["tenant"] == seen["tenant"]
        if not seen["cancelled"]:
            assert row["status"] == "finished" and row["completion_tokens"] == seen["received"]
            continue
        assert row["status"] == "cancelled"
        # Billed exactly what the scheduler generated before it dropped the request, which is more than the
        # client read only by the tokens in flight and those of the abort latency, at the rate the stream ran.
        _, generated = aborted[row["record_id"]]  # the scheduler knows requests by their record id
        assert row["completion_tokens"] == generated
        # At least what the client read, and the cancel stopped the generation before its end. (No bound from
        # wall-clock rates: on a loaded machine the client reads in bursts.)
        assert seen["received"] <= row["completion_tokens"] < seen["max_tokens"]

    usage = daemon.usage_report()
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
        assert daemon.metric("tokend:tenant_cached_tokens_total", tenant=tenant) == usage[tenant]["cached_tokens"]
        assert daemon.metric("tokend:tenant_requests_total", tenant=tenant) == usage[tenant]["requests"]
    assert _get_usage(daemon) == usage  # the Admin RPC reports the very same totals as the CLI


def test_usage_since_a_time_counts_only_the_requests_started_from_then(daemon):
    list(daemon.generation.Generate(_short("before"), metadata=_as("initech"), timeout=30))
    since = time.time()
    for name in ("after-1", "after-2"):
        list(daemon.generation.Generate(_short(name), metadata=_as("initech"), timeout=30))
    rows = [row for row in _rows(daemon).values() if row["started_at"] >= since]
    assert sorted(row["request_id"] for row in rows) == ["after-1", "after-2"]
    expected = {
        "initech": {
            "requests": 2,
            "prompt_tokens": sum(row["prompt_tokens"] for row in rows),
            "completion_tokens": 10,
            "cached_tokens": sum(row["cached_tokens"] for row in rows),
            "cancelled": 0,
        }
    }
    iso = datetime.fromtimestamp(since, tz=UTC).isoformat()
    assert daemon.usage_report("--since", str(since)) == expected
    assert daemon.usage_report("--since", iso) == expected
    assert _get_usage(daemon, since) == expected
    bad = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "usage", "--state-dir", daemon.state_dir, "--since", "yesterday"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "since" in bad.stderr and "'yesterday'" in bad.stderr


def test_a_running_request_is_checkpointed_every_second(daemon):
    """While a long request runs, its counts so far reach the ledger about every second (what a crashed
    frontend leaves behind)."""
    requests = [
        pb.GenerateRequest(
            prompt=f"long {index}",
            request_id=f"c-{index}",
            sampling=pb.SamplingParams(max_tokens=1900, ignore_eos=True, temperature=0),
        )
        for index in range(6)  # six at once, so that each runs for several seconds
    ]
    arrivals: list[float] = []  # when each chunk of the watched request reached the client

    def read(request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        chunks = []
        for chunk in daemon.generation.Generate(request, metadata=_as("acme"), timeout=120):
            chunks.append(chunk)
            if request.request_id == "c-0":
                arrivals.append(time.monotonic())
        return chunks

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(read, request) for request in requests]
        seen: list[tuple[float, int]] = []  # (when the watched row's count changed, the count)
        polls: list[float] = []  # when each look at the ledger began
        while not futures[0].done():
            polls.append(time.monotonic())
            row = _rows(daemon).get("c-0")
            if row is not None and row["status"] == "running" and (not seen or row["completion_tokens"] != seen[-1][1]):
                seen.append((time.monotonic(), row["completion_tokens"]))
            time.sleep(0.02)
        results = [future.result() for future in futures]
    assert results[0][-1].usage.completion_tokens == 1900
    counts = [count for _, count in seen]
    assert len(counts) >= 3 and counts == sorted(counts) and counts[-1] > counts[0], seen
    gaps = [later - earlier for (earlier, _), (later, _) in zip(seen[1:], seen[2:], strict=False)]
    # A checkpoint each second; a count can only stand still longer while no token came (a loaded machine
    # stalls the stream itself), and each change is seen up to one look at the ledger late: the bound is the second
    # plus the stream's own longest pause plus two of this loop's longest intervals between looks, as measured.
    pauses = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
    looks = max(later - earlier for earlier, later in zip(polls, polls[1:], strict=False))
    assert max(gaps) < 1.0 + max(pauses) + 2 * looks + 0.5, (gaps, max(pauses), looks)


def test_a_killed_frontend_loses_no_finished_record_and_marks_the_rest_interrupted(daemon):
    finished: dict[str, int] = {}
    received_by: dict[str, int] = {}
    lock = threading.Lock()
    killed = threading.Event()
    started = time.monotonic()

    def kill_the_frontend_now() -> None:
        (frontend,) = daemon.child_pids("tokend: frontend")
        os.kill(frontend, signal.SIGKILL)
        killed.set()

    def run(index: int) -> None:
        request = pb.GenerateRequest(
            prompt=f"crash {index}",
            request_id=f"k-{index}",
            # Up to 1,890 tokens (the tiny model's context is 2,048): the longest outlast the kill on a fast machine.
            sampling=pb.SamplingParams(max_tokens=20 + 170 * index, ignore_eos=True, temperature=0),
        )
        received = 0
        with contextlib.suppress(grpc.RpcError):
            for chunk in daemon.generation.Generate(request, metadata=_as("globex"), timeout=120):
                received += len(chunk.token_ids)
                received_by[request.request_id] = received
                if chunk.finish_reason:
                    with lock:
                        finished[request.request_id] = received
                        # Killed the instant a client sees its request end, once some have finished and the
                        # rest have been checkpointed at least once (each second): that request's record must be there.
                        if not killed.is_set() and len(finished) >= 3 and time.monotonic() - started > 1.5:
                            kill_the_frontend_now()

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(run, index) for index in range(12)]
        assert killed.wait(timeout=60), "no request finished after the first checkpoints"
        for future in futures:
            future.result(timeout=120)
    assert 3 <= len(finished) < 12
    daemon.wait_for(lambda: daemon.health_status() == health_pb2.HealthCheckResponse.SERVING, timeout=60)
    rows = _rows(daemon)
    for request_id, received in finished.items():
        assert (rows[request_id]["status"], rows[request_id]["completion_tokens"]) == ("finished", received)
    unfinished = [rows[f"k-{i}"] for i in range(12) if f"k-{i}" not in finished]
    assert all(row["status"] == "interrupted" for row in unfinished)

    # Their schedulers stopped them and told the new frontend what each really generated: their rows hold it.
    def final_counts() -> dict[str, int]:
        return {e["request_id"]: e["completion_tokens"] for e in daemon.log_entries("orphan_finished")}

    def settled() -> bool:
        finals, rows = final_counts(), _rows(daemon)
        return all(rows[r["request_id"]]["completion_tokens"] == finals.get(r["record_id"]) for r in unfinished)

    daemon.wait_for(settled, timeout=30)
    rows = _rows(daemon)
    for row in unfinished:
        row = rows[row["request_id"]]
        assert row["status"] == "interrupted"
        assert received_by.get(row["request_id"], 0) <= row["completion_tokens"]
    with daemon.ledger() as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # readers never block the frontend


def _aborted(daemon: Daemon) -> dict[str, tuple[float, int]]:
    """When each aborted request's scheduler dropped it, and the tokens it had generated by then (its
    `request_aborted` log line)."""
    return {
        entry["request_id"]: (datetime.fromisoformat(entry["timestamp"]).timestamp(), entry["completion_tokens"])
        for entry in daemon.log_entries("request_aborted")
    }


def _short(request_id: str) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=f"short {request_id}",
        request_id=request_id,
        sampling=pb.SamplingParams(max_tokens=5, ignore_eos=True, temperature=0),
    )


def _get_usage(daemon: Daemon, since: float = 0.0) -> dict[str, dict[str, int]]:
    reply = daemon.admin.GetUsage(pb.GetUsageRequest(since_unix=since), metadata=_as("acme"), timeout=10)
    return {name: {field: getattr(usage, field) for field in USAGE_FIELDS} for name, usage in reply.tenants.items()}
