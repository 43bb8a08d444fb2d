"""Priority admission against a real `tokend serve`: interactive first, batch shed first, tenant limits, fairness."""

from __future__ import annotations

import asyncio
import hashlib
import re
import time

import grpc
import httpx
import pytest
from daemon_harness import Daemon

from frontend.admission import SPARE_WINDOW_S
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


def _tenant(name: str, **fields) -> str:
    lines = [f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{hashlib.sha256(name.encode()).hexdigest()}"']
    lines += [f"{key} = {value!r}".replace("'", '"') for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def _as(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tenant}"),)


def _request(index: int, max_tokens: int, priority=pb.PRIORITY_UNSPECIFIED) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt=f"request {index}",
        request_id=f"r-{index}-{max_tokens}-{priority}",
        priority=priority,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
    )


async def _stream(stub, request: pb.GenerateRequest, tenant: str, first_token: asyncio.Event | None = None) -> dict:
    """When the first token arrived (`first_token` is set then), how many tokens came, and the error code if it
    failed."""
    seen = {"request_id": request.request_id, "tenant": tenant, "first_at": None, "tokens": 0, "code": None}
    try:
        async for chunk in stub.Generate(request, metadata=_as(tenant), timeout=300):
            if seen["first_at"] is None and chunk.token_ids:
                seen["first_at"] = time.monotonic()
                if first_token is not None:
                    first_token.set()
            seen["tokens"] += len(chunk.token_ids)
        seen["done_at"] = time.monotonic()
    except grpc.aio.AioRpcError as error:
        seen["code"], seen["details"] = error.code(), error.details()
        seen["pushback_ms"] = dict(error.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
    return seen


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("admission") / "tokend.toml"
    config.write_text(
        "max_num_seqs = 4\nmax_queued_requests = 6\n"
        # Targets no projection can miss here: these tests are about order and queue bounds, not projections.
        "interactive_ttft_target = 1000\nbatch_ttft_target = 1000\n"
        + _tenant("chat", priority="interactive")
        + _tenant("jobs", priority="batch", max_priority="batch")
    )
    with Daemon("--config", str(config)) as running:
        yield running


def _queued(daemon: Daemon, priority: str) -> float:
    return daemon.metric("tokend:admission_queue_depth", priority=priority)


def _admission_counts(daemon: Daemon) -> dict[str, float]:
    return {
        "shed batch queue_full": daemon.metric("tokend:admission_shed_total", priority="batch", reason="queue_full"),
        "shed interactive": daemon.metric("tokend:admission_shed_total", priority="interactive"),
        "admitted interactive": daemon.metric("tokend:admission_admitted_total", priority="interactive"),
        "queued interactive": daemon.metric("tokend:admission_queued_total", priority="interactive"),
        "admitted batch": daemon.metric("tokend:admission_admitted_total", priority="batch"),
    }


def test_interactive_requests_start_ahead_of_every_queued_batch_request(daemon):
    async def scenario():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            requests = [_request(i, 300) for i in range(8)]
            streaming = [asyncio.Event() for _ in requests]
            batch = [asyncio.create_task(_stream(stub, r, "jobs", e)) for r, e in zip(requests, streaming, strict=True)]
            # 4 run (the scheduler's depth, as its load report says), 4 wait in the frontend's queue.
            await asyncio.to_thread(daemon.wait_for, lambda: _queued(daemon, "batch") == 4, 30)
            await asyncio.to_thread(daemon.wait_for, lambda: daemon.metric("tokend:num_requests_running") == 4, 30)
            # The running four have streamed a token: none of them is still on its way in when the chats come.
            waits = {asyncio.ensure_future(event.wait()) for event in streaming}
            async with asyncio.timeout(60):
                while sum(event.is_set() for event in streaming) < 4:
                    _, waits = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            queued = [r.request_id for r, event in zip(requests, streaming, strict=True) if not event.is_set()]
            chats = [asyncio.create_task(_stream(stub, _request(i, 16), "chat")) for i in range(4)]
            return await asyncio.gather(*batch), await asyncio.gather(*chats), queued

    batch, chats, queued = asyncio.run(scenario())
    assert all(s["code"] is None for s in batch + chats), [s.get("details") for s in batch + chats]
    queued_batch = [s for s in batch if s["request_id"] in queued]  # still waiting when the chats arrived
    assert len(queued_batch) == 4
    assert max(c["first_at"] for c in chats) < min(b["first_at"] for b in queued_batch)
    assert daemon.metric("tokend:num_preemptions_total") >= 1  # chats took running batch requests' slots


def test_a_full_queue_sheds_batch_first_and_says_when_to_retry(daemon):
    before = _admission_counts(daemon)
    preempted_before = daemon.metric("tokend:num_preemptions_total")  # the test before this one preempted some
    # The scheduler's report says it is idle first: a stale "4 running" from the test before would let the chats
    # come while the frontend still sees fewer batch slots to take than four.
    daemon.wait_for(lambda: daemon.metric("tokend:num_requests_running") == 0, 60)

    async def scenario():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # Four batch streams as long as the context allows take every slot and hold it for seconds even on a fast
            # machine (a queue that drained as they finished would take the chats without shedding anything); six
            # short ones fill the queue.
            running = [asyncio.create_task(_stream(stub, _request(100 + i, 2030), "jobs")) for i in range(4)]
            await asyncio.to_thread(daemon.wait_for, lambda: daemon.metric("tokend:num_requests_running") == 4, 30)
            batch = [asyncio.create_task(_stream(stub, _request(110 + i, 10), "jobs")) for i in range(6)]
            await asyncio.to_thread(daemon.wait_for, lambda: _queued(daemon, "batch") == 6, 30)
            extra_batch = await _stream(stub, _request(200, 10), "jobs")  # the queue is full: shed at once
            # Two chats go straight in, beyond the batch's depth; the third must wait, so a batch one makes room.
            chats = [asyncio.create_task(_stream(stub, _request(201 + i, 200), "chat")) for i in range(2)]
            preempted = lambda: daemon.metric("tokend:num_preemptions_total") >= preempted_before + 2  # noqa: E731
            await asyncio.to_thread(daemon.wait_for, preempted, 30)
            chats.append(asyncio.create_task(_stream(stub, _request(203, 10), "chat")))
            chats = await asyncio.gather(*chats)
            for stream in running:  # done with them: the queued short ones run next
                stream.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            return await asyncio.gather(*batch), extra_batch, chats

    batch, extra_batch, chats = asyncio.run(scenario())
    assert extra_batch["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in" in extra_batch["details"]
    assert [chat["code"] for chat in chats] == [None] * 3 and chats[-1]["tokens"] == 10
    shed = [s for s in batch if s["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(shed) == 1 and shed[0]["tokens"] == 0  # one batch request still queued (the newest) gave way
    # The metrics say what happened, by class and reason: two batch requests shed for a full queue, the nine
    # others admitted; all three chats admitted, the third after a wait; no interactive request shed.
    counted = {key: value - before[key] for key, value in _admission_counts(daemon).items()}
    assert counted == {
        "shed batch queue_full": 2,
        "shed interactive": 0,
        "admitted batch": 9,
        "admitted interactive": 3,
        "queued interactive": 1,
    }
    with daemon.ledger() as db:
        statuses = dict(db.execute("SELECT request_id, status FROM usage WHERE request_id IN (?, ?)",
                                   (extra_batch["request_id"], shed[0]["request_id"])).fetchall())  # fmt: skip
        admitted_jobs = db.execute("SELECT COUNT(*) FROM usage WHERE tenant = 'jobs' AND status != 'shed'").fetchone()
    assert set(statuses.values()) == {"shed"}
    assert daemon.usage_report()["jobs"]["requests"] == admitted_jobs[0]  # shed requests are not usage


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    config = tmp_path_factory.mktemp("limits") / "tokend.toml"
    config.write_text(
        "max_num_seqs = 2\nbatch_max_queue_wait = 0.5\n"
        + _tenant("few", max_concurrent=2)
        + _tenant("thrifty", tokens_per_minute=60)
        + _tenant("by_use", tokens_per_minute=600)
        + _tenant("a", priority="batch")
        + _tenant("b", priority="batch")
    )
    with Daemon("--config", str(config)) as running:
        yield running


def test_tenant_limits_refuse_with_a_retry_hint(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            running = [asyncio.create_task(_stream(stub, _request(300 + i, 300), "few")) for i in range(2)]
            await asyncio.to_thread(limited.wait_for, lambda: limited.metric("tokend:num_requests_running") == 2, 30)
            third = await _stream(stub, _request(302, 5), "few")
            spent = await _stream(stub, _request(303, 80), "thrifty")  # 80+ tokens of a 60-a-minute budget
            broke = await _stream(stub, _request(304, 5), "thrifty")
            return third, spent, broke, await asyncio.gather(*running)

    third, spent, broke, running = asyncio.run(scenario())
    assert third["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent" in third["details"]
    assert spent["code"] is None
    assert broke["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in broke["details"]
    assert all(s["code"] is None for s in running)
    # The hint, in words and as gRPC's server pushback; through the gateway, a 429 whose Retry-After says it.
    retry_in_s = int(re.search(r"retry in (\d+) s", broke["details"]).group(1))
    assert retry_in_s > 1 and abs(int(broke["pushback_ms"]) / 1000 - retry_in_s) <= 1
    reply = httpx.post(f"{limited.http_url}/v1/completions", headers={"Authorization": "Bearer thrifty"},
                       json={"model": TINY_RANDOM_MODEL_NAME, "prompt": "Hi", "max_tokens": 2}, timeout=30)  # fmt: skip
    assert reply.status_code == 429 and "tokens_per_minute" in reply.json()["error"]["message"]
    assert abs(int(reply.headers["Retry-After"]) - retry_in_s) <= 1


def test_tokens_per_minute_charges_the_tokens_a_request_really_used_not_what_it_asked_for(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # Asks for far more than the budget, but its client cancels after a few tokens: a few are charged.
            call = stub.Generate(_request(310, 2000), metadata=_as("by_use"), timeout=60)
            async for _ in call:
                break
            call.cancel()
            right_after = await _stream(stub, _request(311, 700), "by_use")  # in budget, and uses more than it
            broke = await _stream(stub, _request(312, 5), "by_use")
            return right_after, broke

    right_after, broke = asyncio.run(scenario())
    assert right_after["code"] is None and right_after["tokens"] == 700
    assert broke["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in broke["details"]


def test_batch_work_gets_only_the_slots_interactive_work_left_spare_lately(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # Interactive work fills both slots, briefly: seen running together, then cancelled (two short requests
            # might not overlap at all on a loaded machine). Then the pool is idle again.
            filling = [asyncio.create_task(_stream(stub, _request(350 + i, 300), "few")) for i in range(2)]
            await asyncio.to_thread(limited.wait_for, lambda: limited.metric("tokend:num_requests_running") == 2, 30)
            for task in filling:
                task.cancel()
            await asyncio.gather(*filling, return_exceptions=True)
            right_after = await _stream(stub, _request(352, 5), "a")  # may wait 0.5 s: the window is longer
            assert _batch_slots(limited) < 2
            # Interactive work's peak leaves the window (SPARE_WINDOW_S) and batch gets both slots back.
            await asyncio.to_thread(limited.wait_for, lambda: _batch_slots(limited) == 2, SPARE_WINDOW_S + 30)
            later = await _stream(stub, _request(353, 5), "a")
            return right_after, later

    right_after, later = asyncio.run(scenario())
    assert right_after["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_wait" in right_after["details"]
    assert later["code"] is None and later["tokens"] == 5


def _batch_slots(daemon) -> float:
    return daemon.metric("tokend:admission_batch_slots", model_name=TINY_RANDOM_MODEL_NAME)


def test_a_batch_request_that_waits_too_long_is_shed(limited):
    # Past earlier tests' interactive peaks, when batch keeps slots free.
    limited.wait_for(lambda: _batch_slots(limited) == 2, SPARE_WINDOW_S + 30)

    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            hogs = [asyncio.create_task(_stream(stub, _request(400 + i, 1500), "a")) for i in range(2)]
            await asyncio.to_thread(limited.wait_for, lambda: limited.metric("tokend:num_requests_running") == 2, 30)
            late = await _stream(stub, _request(402, 5), "b")
            for hog in hogs:
                hog.cancel()
            return late

    late = asyncio.run(scenario())
    assert late["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_wait" in late["details"]


@pytest.fixture(scope="module")
def pressured(tmp_path_factory):
    config = tmp_path_factory.mktemp("pressure") / "tokend.toml"
    config.write_text(
        # An interactive target that any wait breaks, so that a queued interactive request is pressure; batch
        # targets no projection can miss, so that only interactive pressure sheds here.
        "max_num_seqs = 2\ninteractive_ttft_target = 0.05\nbatch_ttft_target = 1000\nbatch_max_queue_wait = 1000\n"
        + _tenant("chat", priority="interactive")
        + _tenant("jobs", priority="batch")
    )
    with Daemon("--config", str(config)) as running:
        yield running


def test_interactive_pressure_sheds_queued_batch_work_and_interactive_only_when_no_batch_can_make_room(pressured):
    daemon = pressured

    def shed(priority: str, reason: str) -> float:
        return daemon.metric("tokend:admission_shed_total", priority=priority, reason=reason)

    async def with_batch_running(stub):
        hogs = [asyncio.create_task(_stream(stub, _request(700 + i, 1500), "jobs")) for i in range(2)]
        await asyncio.to_thread(daemon.wait_for, lambda: daemon.metric("tokend:num_requests_running") == 2, 30)
        queued = [asyncio.create_task(_stream(stub, _request(702 + i, 5), "jobs")) for i in range(2)]
        await asyncio.to_thread(daemon.wait_for, lambda: _queued(daemon, "batch") == 2, 30)
        # The first chat takes a running batch request's slot; the second must wait, which breaks its target:
        # the queued batch work gives way, and the chat waits, since running batch work will make room.
        chats = [asyncio.create_task(_stream(stub, _request(704, 1000), "chat"))]  # still running at the next
        await asyncio.to_thread(daemon.wait_for, lambda: daemon.metric("tokend:num_preemptions_total") >= 1, 30)
        chats.append(asyncio.create_task(_stream(stub, _request(705, 10), "chat")))
        queued, chats = await asyncio.gather(*queued), await asyncio.gather(*chats)
        for hog in hogs:
            hog.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)
        return queued, chats

    async def with_no_batch_work(stub):
        # Interactive alone is beyond capacity: the two that cannot start are refused, not left to miss it.
        await asyncio.to_thread(daemon.wait_for, lambda: daemon.metric("tokend:num_requests_running") == 0, 30)
        # 1,500 tokens each: the two that start still hold their slots when the last arrives on a busy machine.
        return await asyncio.gather(*(_stream(stub, _request(710 + i, 1500), "chat") for i in range(4)))

    async def scenario():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            return await with_batch_running(stub), await with_no_batch_work(stub)

    (queued_batch, chats), alone = asyncio.run(scenario())
    assert [s["code"] for s in queued_batch] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert all("interactive_pressure" in s["details"] for s in queued_batch)
    assert [(s["code"], s["tokens"]) for s in chats] == [(None, 1000), (None, 10)]
    assert shed("batch", "interactive_pressure") == 2
    refused = [s for s in alone if s["code"] is not None]
    assert [s["code"] for s in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert all("projected_ttft" in s["details"] and "retry in" in s["details"] for s in refused)
    assert sorted(s["tokens"] for s in alone) == [0, 0, 1500, 1500]
    assert shed("interactive", "projected_ttft") == 2


@pytest.fixture(scope="module")
def fair(tmp_path_factory):
    config = tmp_path_factory.mktemp("fair") / "tokend.toml"
    config.write_text(
        "max_num_seqs = 2\nbatch_ttft_target = 1000\nbatch_max_queue_wait = 1000\n"  # order, not shedding
        + _tenant("a", priority="batch")
        + _tenant("b", priority="batch")
        + _tenant("c", priority="batch")
    )
    with Daemon("--config", str(config)) as running:
        yield running


def test_two_backlogged_batch_tenants_share_tokens_fairly_whatever_their_request_counts(fair):
    async def scenario():
        async with grpc.aio.insecure_channel(fair.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            # A third tenant holds both slots until both backlogs are queued, so that neither tenant's head
            # start (the order their requests reach the server) can count as unfairness.
            hogs = [asyncio.create_task(_stream(stub, _request(490 + i, 1500), "c")) for i in range(2)]
            await asyncio.to_thread(fair.wait_for, lambda: fair.metric("tokend:num_requests_running") == 2, 30)
            heavy = [asyncio.create_task(_stream(stub, _request(500 + i, 32), "a")) for i in range(80)]
            light = [asyncio.create_task(_stream(stub, _request(600 + i, 32), "b")) for i in range(8)]
            await asyncio.to_thread(fair.wait_for, lambda: _queued(fair, "batch") == 88, 60)
            for hog in hogs:
                hog.cancel()
            light_results = await asyncio.gather(*light)
            done_heavy = [task.result() for task in heavy if task.done()]
            for task in heavy:  # the rest of the heavy tenant's backlog does not matter any more
                task.cancel()
            await asyncio.gather(*hogs, *heavy, return_exceptions=True)
            return done_heavy, light_results

    heavy, light = asyncio.run(scenario())
    assert all(s["code"] is None for s in heavy + light)
    # Both tenants are backlogged until the light one's last request starts: shares are measured up to there.
    last_light_start = max(s["first_at"] for s in light)
    served_heavy = sum(s["tokens"] for s in heavy if s["first_at"] < last_light_start)
    served_light = sum(s["tokens"] for s in light)
    share = served_light / (served_light + served_heavy)
    assert 0.4 <= share <= 0.6, (served_light, served_heavy)


def test_a_request_id_waiting_for_admission_is_still_taken(daemon):
    async def scenario():
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            originals = [_request(700 + i, 1500) for i in range(5)]  # long: all still there when duplicated
            batch = [asyncio.create_task(_stream(stub, request, "jobs")) for request in originals]
            # Four run, one waits for a slot: every one of the five ids is taken, wherever its request is.
            await asyncio.to_thread(daemon.wait_for, lambda: _queued(daemon, "batch") == 1, 30)
            duplicates = [
                await _stream(stub, pb.GenerateRequest(prompt="dup", request_id=r.request_id), "jobs")
                for r in originals
            ]
            for task in batch:
                task.cancel()
            await asyncio.gather(*batch, return_exceptions=True)
            return duplicates

    duplicates = asyncio.run(scenario())
    assert [s["code"] for s in duplicates] == [grpc.StatusCode.INVALID_ARGUMENT] * 5
    assert all(s["details"].startswith("request_id") for s in duplicates)
