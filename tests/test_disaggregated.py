"""Prefill and decode pools: a daemon with one prefill and one decode worker (`--device cpu=prefill,cpu=decode`)
hands each long prompt's KV pages from the first to the second, and its clients cannot tell: the same greedy
tokens and counts as a daemon of `mixed` workers, over gRPC and the gateway; nothing leaks when requests are
cancelled at any point; a lease nobody pulls expires. Each with the ZeroMQ transport, and NIXL's where it imports
(but the gateway's test: the gateway speaks gRPC to the frontend, whatever moves the pages below it).

Shown in process instead of on a daemon of their own: a P/D surge with a spare decode group only (the prefill
pool in place; test_worker_pool.py, a decode worker serving at every tick), and a surge refused for want of a
spare decode group (test_rollout_paths.py)."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import msgspec
import openai
import pytest
import zmq
from checkpoints import LLAMA_GQA, write_checkpoint
from daemon_harness import Daemon

from gpu_runtime.kv_transfer.nixl_transport import nixl_available
from gpu_runtime.kv_transfer.wire import PullPages
from tokend.v1 import tokend_pb2 as pb

MIN_PROMPT = 16  # --disagg-min-prompt-tokens: shorter prompts go straight to the decode worker
PD_FLAGS = ("--device", "cpu=prefill,cpu=decode", "--disagg-min-prompt-tokens", str(MIN_PROMPT))


def _request(prompt: list[int], max_tokens: int, ignore_eos: bool = True) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def _generate(daemon: Daemon, request: pb.GenerateRequest) -> tuple[list[int], str, str, tuple[int, int]]:
    chunks = list(daemon.generation.Generate(request, timeout=120))
    usage = chunks[-1].usage
    tokens = [t for c in chunks for t in c.token_ids]
    return (
        tokens,
        "".join(c.text for c in chunks),
        chunks[-1].finish_reason,
        (usage.prompt_tokens, usage.completion_tokens),
    )


def _prompts(count: int, seed: int, longest: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, longest))] for _ in range(count)]


TRANSPORTS = ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl not installed"))]


@pytest.fixture(scope="module", params=TRANSPORTS)
def disaggregated(request):
    with Daemon(*PD_FLAGS, "--kv-lease-seconds", "3", "--kv-transfer-transport", request.param) as daemon:
        yield daemon


@pytest.mark.parametrize(("on_failure", "outcome"), [("recompute", "length"), ("fail", grpc.StatusCode.UNAVAILABLE)])
def test_a_pull_that_fails_is_recomputed_or_fails_as_configured(reference, on_failure, outcome):
    """Leases that expire at once: every pull is refused, and kv_load_failure says what the request gets."""
    flags = (*PD_FLAGS, "--kv-lease-seconds", "0.001", "--kv-load-failure", on_failure)
    index = LONG_GREEDY  # a prompt that is handed over, whose answer the mixed daemon gave
    request = _request(PROMPTS[index], MAX_TOKENS, _ignores_eos(index))
    with Daemon(*flags) as daemon:
        if outcome == "length":
            assert _generate(daemon, request) == reference[0][index]
        else:
            with pytest.raises(grpc.RpcError) as failed:
                _generate(daemon, request)
            assert (
                failed.value.code() == outcome and "could not be moved to the decode worker" in failed.value.details()
            )
        # The outcome above is the action kv_load_failure names; the failure is counted from the next load report.
        daemon.wait_for(lambda: daemon.metric("tokend:kv_transfer_failures_total") >= 1, timeout=10)


def _loads(daemon: Daemon) -> dict[str, pb.SchedulerLoad]:
    return {s.role: s for s in daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers}


PROMPTS = _prompts(120, seed=7, longest=640)  # up to 40 pages handed over
MAX_TOKENS = 6


def _ignores_eos(index: int) -> bool:
    return index % 2 == 0  # the others may stop at EOS, on either worker


LONG_GREEDY = next(i for i, p in enumerate(PROMPTS) if _ignores_eos(i) and len(p) >= 100)  # runs all MAX_TOKENS


@pytest.fixture(scope="module")
def reference():
    """What a daemon of mixed workers answers to PROMPTS over gRPC: (tokens, text, finish reason, usage) each, and
    its ledger's totals."""
    requests = [_request(p, MAX_TOKENS, _ignores_eos(i)) for i, p in enumerate(PROMPTS)]
    with Daemon() as mixed, ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda r: _generate(mixed, r), requests)), mixed.usage_report()


def test_a_prefill_and_a_decode_worker_give_the_tokens_of_mixed_workers(disaggregated, reference):
    """120 random prompts of 1-640 tokens, half of them free to stop at EOS: token ids, finish reasons and
    usage equal the mixed daemon's, the ledger's totals too (one row per request), and every prompt of MIN_PROMPT
    tokens or more went through a handover."""
    expected, expected_usage = reference
    requests = [_request(p, MAX_TOKENS, _ignores_eos(i)) for i, p in enumerate(PROMPTS)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda r: _generate(disaggregated, r), requests))
    mismatched = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    assert not mismatched, [(len(PROMPTS[i]), expected[i], got[i]) for i in mismatched[:3]]
    assert disaggregated.usage_report() == expected_usage

    admitted = disaggregated.log_entries("request_admitted")  # logged before the request was sent anywhere
    handed = [e for e in admitted if e["decode_worker"]]
    not_handed = [e for e in admitted if not e["decode_worker"] and e["prompt_tokens"] >= MIN_PROMPT]
    assert not not_handed, (not_handed[:3], disaggregated.failure_report())
    assert len(handed) == sum(len(p) >= MIN_PROMPT for p in PROMPTS)  # every long prompt, and only those
    assert all(e["worker"].endswith("/0") and e["decode_worker"].endswith("/1") for e in handed)
    assert disaggregated.metric("tokend:kv_transfer_pages_total") > 0
    assert disaggregated.metric("tokend:kv_transfer_failures_total") == 0
    roles = _loads(disaggregated)
    assert sorted(roles) == ["decode", "prefill"]


@pytest.mark.parametrize("disaggregated", ["zmq"], indirect=True)  # see the module's docstring
def test_the_gateway_serves_disaggregated_requests_as_the_mixed_daemon_does(disaggregated, reference):
    """The official openai client against the gateway, the same 120 prompts: the text, finish reason and usage
    equal the mixed daemon's over gRPC."""
    expected, _ = reference

    def completion(index: int) -> tuple[str, str, tuple[int, int]]:
        chunks = list(
            client.completions.create(
                model="tokend-tiny-random",
                prompt=PROMPTS[index],
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": _ignores_eos(index)},
            )  # fmt: skip
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        return text, reason, (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens)

    client = openai.OpenAI(base_url=f"{disaggregated.http_url}/v1", api_key="unused", max_retries=0)
    with client, ThreadPoolExecutor(6) as pool:
        got = list(pool.map(completion, range(len(PROMPTS))))
    assert got == [(text, reason, usage) for _, text, reason, usage in expected]


def _cancel_some(daemon: Daemon, prompts: list[list[int]], seed: int) -> int:
    """Runs every prompt, cancelling about a third at a random moment (some before their first token, during
    the prefill or the handover); returns how many were cancelled."""
    rng = random.Random(seed)
    plan = [(p, rng.randint(2, 24), rng.random() < 1 / 3, rng.uniform(0.0, 0.3)) for p in prompts]

    def one(item) -> bool:
        prompt, max_tokens, cancel, after = item
        call = daemon.generation.Generate(_request(prompt, max_tokens), timeout=120)
        if not cancel:
            list(call)
            return False
        time.sleep(after)
        call.cancel()
        try:
            list(call)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED
        return True

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(one, plan))


def _settled(daemon: Daemon, baseline: dict[str, int]) -> bool:
    loads = _loads(daemon)
    return all(
        loads[role].num_used_pages == used and loads[role].kv_leases_held == 0 and loads[role].num_running == 0
        for role, used in baseline.items()
    )


def test_cancelled_requests_leave_no_page_and_no_lease_on_either_side(disaggregated):
    """400 requests, a third cancelled at random points (about 130: before the first token, in the prefill, in the
    handover, while decoding): used pages on both workers return to their baseline and no lease is left, within
    the lease time. Every point of the request session's life is aborted in process: test_request_session*.py."""
    baseline = {"prefill": 0, "decode": 0}  # idle workers hold no page: cached pages are free ones
    disaggregated.wait_for(lambda: _settled(disaggregated, baseline), timeout=30)  # the earlier tests' last leases
    cancelled = _cancel_some(disaggregated, _prompts(400, seed=9, longest=400), seed=10)
    assert 90 < cancelled < 180
    try:
        disaggregated.wait_for(lambda: _settled(disaggregated, baseline), timeout=30)
    except AssertionError:
        raise AssertionError(f"baseline {baseline}, now {_loads(disaggregated)}") from None
    assert _generate(disaggregated, _request(_prompts(1, 11, 300)[0], 4))[2] == "length"  # and it still serves


def test_garbage_on_the_kv_socket_costs_nothing(disaggregated):
    """A peer that writes junk (and a pickle) to the prefill worker's pull socket is dropped; pulls go on."""
    socket_path = next(disaggregated.runtime_dir().glob("kv-*.ipc"))
    context = zmq.Context()
    try:
        for frames in ([b"\x80\x04junk"], [b"\x93\x01\x02\x03"], [b"a", b"b", b"c"]):
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(f"ipc://{socket_path}")
            dealer.send_multipart(frames)
            dealer.close()
        # A well-formed pull of a lease that does not exist is refused, by name.
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"ipc://{socket_path}")
        dealer.send(msgspec.msgpack.encode(PullPages("nope", [0])))
        assert dealer.poll(10_000)
        assert b"nope" in dealer.recv()
        dealer.close()
    finally:
        context.term()
    before = disaggregated.metric("tokend:kv_transfer_pages_total")
    tokens = _generate(disaggregated, _request(_prompts(1, 12, 200)[0], 4))[0]
    assert len(tokens) == 4
    disaggregated.wait_for(lambda: disaggregated.metric("tokend:kv_transfer_pages_total") > before, timeout=10)


@pytest.fixture(scope="module")
def faults():
    """A P/D daemon whose workers the next two tests stop and kill, one after the other (each waits for both to
    serve first); a liveness timeout they never reach, so that a stopped worker is only ever stopped."""
    with Daemon(*PD_FLAGS, "--kv-lease-seconds", "2", "--liveness-timeout", "30") as daemon:
        yield daemon


def _both_ready(daemon: Daemon) -> bool:
    loads = _loads(daemon)
    return sorted(loads) == ["decode", "prefill"] and all(load.ready for load in loads.values())


def test_a_lease_of_a_decode_worker_that_died_expires_and_frees_the_prefill_side(faults):
    """The decode worker is stopped, so a request's handover waits on it with the prefill worker's lease held;
    then it is killed: the stream ends UNAVAILABLE, the lease expires after kv_lease_seconds and the prefill
    worker's pages return to their baseline; the daemon restarts the decode worker, which serves again."""
    daemon = faults
    daemon.wait_for(lambda: _both_ready(daemon), timeout=60)
    baseline = _loads(daemon)["prefill"].num_used_pages
    [decode_pid] = daemon.child_pids("tokend: scheduler tokend-tiny-random 1")
    os.kill(decode_pid, signal.SIGSTOP)
    call = daemon.generation.Generate(_request(_prompts(1, 13, 300)[0], max_tokens=8), timeout=120)
    first = next(call)  # the prefill worker's first token comes out at once
    assert len(first.token_ids) == 1
    daemon.wait_for(lambda: _loads(daemon)["prefill"].kv_leases_held == 1, timeout=10)
    os.kill(decode_pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    daemon.wait_for(lambda: _loads(daemon)["prefill"].kv_leases_held == 0, timeout=15)
    assert _loads(daemon)["prefill"].num_used_pages == baseline
    assert daemon.log_entries("kv_leases_expired")
    daemon.wait_for(lambda: (loads := _loads(daemon)).get("decode") is not None and loads["decode"].ready, timeout=60)
    assert _generate(daemon, _request(_prompts(1, 14, 300)[0], 4))[2] == "length"


def test_a_killed_prefill_worker_ends_its_streams_unavailable_and_is_replaced(faults):
    """The prefill worker is stopped with a long prompt queued on it, then killed: that stream ends UNAVAILABLE,
    the decode worker holds nothing for it, and the restarted prefill worker serves the next long prompt."""
    daemon = faults
    daemon.wait_for(lambda: _both_ready(daemon) and _loads(daemon)["decode"].num_used_pages == 0, timeout=60)
    [prefill_pid] = daemon.child_pids("tokend: scheduler tokend-tiny-random 0")
    os.kill(prefill_pid, signal.SIGSTOP)
    call = daemon.generation.Generate(_request(_prompts(1, 16, 300)[0], max_tokens=8), timeout=120)
    call.initial_metadata()  # the frontend sends its headers once the request went to its (prefill) worker
    os.kill(prefill_pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as ended:
        list(call)
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert _loads(daemon)["decode"].num_used_pages == 0
    daemon.wait_for(lambda: (loads := _loads(daemon)).get("prefill") is not None and loads["prefill"].ready,
                    timeout=60)  # fmt: skip
    tokens, _, reason, _ = _generate(daemon, _request(_prompts(1, 17, 300)[0], 4))
    assert reason == "length" and len(tokens) == 4
    assert daemon.log_entries("request_admitted")[-1]["decode_worker"].endswith("/1")  # it went the P/D way


def test_a_rollout_keeps_both_pools_and_a_decode_worker_serving_throughout(tmp_path):
    """A surge rollout of a P/D daemon with a spare group of each role: each pool's new worker starts on a spare
    group of its own role, some decode worker serves at every moment, and afterwards the new prefill worker hands
    prompts to the new decode worker. Starting the routed pool's worker on a prefill group would leave no decode
    worker once the old drain. (Without a spare prefill group the prefill pool goes in place: test_worker_pool.py.)"""
    spares = "cpu=prefill,cpu=decode"
    checkpoints = {name: write_checkpoint(tmp_path / name, LLAMA_GQA, seed=seed) for name, seed in (("A", 1), ("B", 2))}
    flags = ("--model", str(checkpoints["A"]), "--served-model-name", "m", *PD_FLAGS, "--spare-devices", spares)
    with Daemon(*flags) as daemon:
        reply = daemon.admin.Rollout(pb.RolloutRequest(model="m", path=str(checkpoints["B"]), strategy="surge"))
        assert reply.rollout.epoch == 1
        deadline = time.monotonic() + 300
        while (status := daemon.admin.GetRollout(pb.GetRolloutRequest(model="m")).rollouts[0]).phase == "rolling":
            assert time.monotonic() < deadline, status
            workers = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
            serving = [
                (w.worker_id, w.epoch) for w in workers if w.role == "decode" and w.state == "serving" and w.ready
            ]
            assert serving, [(w.worker_id, w.role, w.state, w.ready) for w in workers]
            time.sleep(0.05)
        assert status.phase == "done", status

        def pools() -> dict[str, list[pb.SchedulerLoad]] | None:
            workers = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
            if any(w.epoch != 1 or not w.ready for w in workers):
                return None  # an old worker still draining, or a new one not ready
            return {role: [w for w in workers if w.role == role] for role in ("prefill", "decode")}

        roles = daemon.wait_for(pools, timeout=60)
        assert [len(roles["prefill"]), len(roles["decode"])] == [1, 1]
        tokens, _, reason, _ = _generate(daemon, _request(_prompts(1, 18, 300)[0], 4))
        assert reason == "length" and len(tokens) == 4
        last = daemon.log_entries("request_admitted")[-1]
        assert (last["worker"], last["decode_worker"]) == (roles["prefill"][0].worker_id, roles["decode"][0].worker_id)


def test_prompt_logprobs_come_from_the_prefill_worker_as_one_process_scores_them(disaggregated):
    """A handed-over request's prompt logprobs are the prefill worker's (on its first chunk, with its first token),
    equal to the engine's in process; the decode worker scores nothing again."""
    from gpu_runtime import LLM, SamplingParams
    from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME

    prompt = _prompts(1, seed=19, longest=300)[0] + list(range(3, 3 + MIN_PROMPT))  # handed over
    request = _request(prompt, 4)
    request.sampling.prompt_logprobs = 2
    moved = disaggregated.metric("tokend:kv_transfer_pages_total")
    chunks = list(disaggregated.generation.Generate(request, timeout=120))
    scored = [chunk.prompt_logprobs for chunk in chunks if chunk.prompt_logprobs]
    assert len(scored) == 1 and len(scored[0]) == len(prompt)
    # It went the P/D way: its pages moved (the count reaches /metrics with the workers' next load reports).
    disaggregated.wait_for(lambda: disaggregated.metric("tokend:kv_transfer_pages_total") > moved, timeout=30)
    with LLM(TINY_RANDOM_MODEL_NAME) as llm:
        [expected] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=2))
    got = [entry.logprob for entry in scored[0][1:]]
    assert got == pytest.approx([entry.logprob for entry in expected.prompt_logprobs[1:]], abs=1e-4)
