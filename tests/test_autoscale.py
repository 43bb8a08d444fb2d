"""The autoscaler on a real daemon: a burst promotes the pre-warmed standby within two ticks, a new standby starts
behind it, and once the load has been quiet for the delay the extra worker drains (no stream cut) and retires;
`tokend:desired_replicas` follows each step."""

from __future__ import annotations

import threading

from daemon_harness import Daemon

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

BURST = 24
QUIET_DELAY_S = 3.0


def _states(daemon: Daemon) -> dict[str, str]:
    return {w.worker_id: w.state for w in daemon.admin.GetLoad(pb.GetLoadRequest()).schedulers}


def _desired(daemon: Daemon) -> float:
    return daemon.metric("tokend:desired_replicas", model_name=TINY_RANDOM_MODEL_NAME, role="mixed")


def _burst(daemon: Daemon, max_tokens: int, until: threading.Event) -> tuple[list[threading.Thread], list, list]:
    """BURST greedy streams of `max_tokens` each, started at once; each thread starts its next stream as one ends
    until `until` is set, so the queue stays past one worker's slots for as long as the test waits on what it
    causes, however fast this machine decodes (a single round of streams can end between two autoscaler ticks).
    Each stream appends (finish reason, completion tokens) to the results or the error to the failures."""
    results, failures = [], []

    def stream(i: int) -> None:
        request = pb.GenerateRequest(
            model=TINY_RANDOM_MODEL_NAME,
            prompt=f"burst {i}",
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        while True:
            try:
                chunks = list(daemon.generation.Generate(request, timeout=300))
                results.append((chunks[-1].finish_reason, chunks[-1].usage.completion_tokens))
            except Exception as error:  # noqa: BLE001 (any failure is what the assertion reports)
                failures.append(repr(error))
                return
            if until.is_set():
                return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(BURST)]
    for thread in threads:
        thread.start()
    return threads, results, failures


def _end(threads: list[threading.Thread], until: threading.Event) -> None:
    until.set()
    for thread in threads:
        thread.join(timeout=300)


def test_a_burst_promotes_the_standby_then_quiet_drains_the_extra_worker():
    flags = ["--model", TINY_RANDOM_MODEL_NAME, "--spare-devices", "cpu,cpu", "--max-num-seqs", "4",
             "--autoscale-max-workers", "2", "--min-standby", "1", "--interactive-ttft-target", "30",
             "--autoscale-scale-down-delay", str(QUIET_DELAY_S)]  # fmt: skip
    with Daemon(*flags) as daemon:
        # At rest: one worker serves and one waits warm beside it.
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "standby"], timeout=120)
        standby = next(w for w, s in _states(daemon).items() if s == "standby")
        daemon.wait_for(lambda: _desired(daemon) == 1, timeout=30)

        until = threading.Event()
        threads, results, failures = _burst(daemon, max_tokens=300, until=until)
        # The queue passes what one worker holds (a generous TTFT target: nothing is shed): the standby serves.
        daemon.wait_for(lambda: _states(daemon).get(standby) == "serving", timeout=60)
        assert _desired(daemon) == 2
        (decision,) = daemon.admin.GetLoad(pb.GetLoadRequest()).autoscale  # the decision and why, over gRPC too
        # The next tick holds two: still for the queue or the TTFT, or steady once the burst is spread over both.
        assert decision.desired_replicas == 2 and decision.reason in ("queue", "ttft", "ceiling", "steady")
        promoted = daemon.log_entries("worker_promoted")
        assert [e["worker"] for e in promoted] == [standby]  # none at start: the configured worker serves first
        # A new standby is started behind it.
        daemon.wait_for(lambda: list(_states(daemon).values()).count("standby") == 1, timeout=120)
        _end(threads, until)
        assert failures == [] and len(results) >= BURST and set(results) == {("length", 300)}
        # Quiet for the delay: one serving worker drains and retires, and the desired count follows.
        daemon.wait_for(lambda: _desired(daemon) == 1, timeout=60 + QUIET_DELAY_S)
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "standby"], timeout=120)  # retired
        assert {e["exit_code"] for e in daemon.log_entries("worker_retired")} == {0}
        # One change each way, as the autoscaler counts them (no spurious "up" while a worker's first load report
        # is on its way: it would count as missing).
        changes = {d: daemon.metric("tokend:autoscaler_decisions_total", direction=d) for d in ("up", "down")}
        assert changes == {"up": 1, "down": 1}, daemon.log_entries("autoscale")
        # Promotion is a routing flip: the "up" decision is followed by the standby serving, with no worker
        # loading in between (the replacement standby starts after it).
        events = [e for e in daemon.log_entries() if e.get("event") in ("autoscale", "worker_promoted",
                                                                           "worker_starting")]  # fmt: skip
        up = next(i for i, e in enumerate(events) if e["event"] == "autoscale" and e["direction"] == "up")
        assert events[up + 1]["event"] == "worker_promoted", events


def test_with_a_declared_peak_quiet_demotes_the_extra_worker_to_a_warm_standby():
    """--autoscale-peak-rps holds warm workers for the peak: at rest the second group waits as a standby, a burst
    promotes it, and when the load is quiet again the extra worker goes back to standby instead of retiring (its
    streams finish there), so the next burst needs no warm-up either."""
    flags = ["--model", TINY_RANDOM_MODEL_NAME, "--spare-devices", "cpu", "--max-num-seqs", "4",
             "--autoscale-max-workers", "2", "--autoscale-peak-rps", "1000", "--interactive-ttft-target", "30",
             "--autoscale-scale-down-delay", str(QUIET_DELAY_S)]  # fmt: skip
    with Daemon(*flags) as daemon:
        # No min_standby: the standby is there for the declared peak (no step time measured yet: all it may hold).
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "standby"], timeout=120)
        standby = next(w for w, s in _states(daemon).items() if s == "standby")
        until = threading.Event()
        threads, results, failures = _burst(daemon, max_tokens=200, until=until)
        daemon.wait_for(lambda: _states(daemon).get(standby) == "serving", timeout=60)
        _end(threads, until)
        assert failures == [] and len(results) >= BURST and set(results) == {("length", 200)}
        # Quiet for the delay: one worker flips back to standby; nothing retires and nothing loads.
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "standby"], timeout=90 + QUIET_DELAY_S)
        assert [e["worker"] for e in daemon.log_entries("worker_demoted")] != []
        assert daemon.log_entries("worker_retired") == []
        assert len(daemon.log_entries("worker_starting")) == 1  # the standby, at start; none since
        (decision,) = daemon.admin.GetLoad(pb.GetLoadRequest()).autoscale
        assert decision.desired_replicas == 1 and decision.desired_standby == 1
        assert decision.peak_requests_per_second == 1000
        assert decision.role == "mixed"
        assert daemon.metric("tokend:desired_standby", model_name=TINY_RANDOM_MODEL_NAME, role="mixed") == 1


def test_prefill_and_decode_pools_scale_apart_each_on_the_spare_groups_of_its_role():
    """With prefill and decode pools, each is a pool of its own: long prompts that back up the prefill worker start
    a second prefill worker on the spare prefill group, and once quiet it drains; the decode worker is never
    drained by the prefill pool's counts (one count for the whole model would have)."""
    flags = ["--model", TINY_RANDOM_MODEL_NAME, "--device", "cpu=prefill,cpu=decode", "--spare-devices", "cpu=prefill",
             "--disagg-min-prompt-tokens", "16", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
             "--autoscale-max-workers", "2", "--interactive-ttft-target", "10", "--autoscale-ttft-fraction", "0.1",
             "--autoscale-scale-down-delay", str(QUIET_DELAY_S), "--autoscale-peak-memory", "0"]  # fmt: skip
    # 64-token steps make a 1,400-token prompt's prefill take 22 of them: a dozen streams back up the prefill
    # worker past 1 s (10 % of the target), while the admission's 8.5 s (85 %) sheds nothing. A peak remembered
    # for 0 s lasts only its own 30 s window: then no warm reserve holds the extra worker back from draining.
    with Daemon(*flags) as daemon:
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "serving"], timeout=120)
        roles = {s.worker_id: s.role for s in daemon.admin.GetLoad(pb.GetLoadRequest()).schedulers}
        (decode,) = [w for w, role in roles.items() if role == "decode"]
        stop, results, failures = threading.Event(), [], []

        def keep_prefilling(i: int) -> None:  # long prompts, a few tokens each: the prefill pool's load
            while not stop.is_set():
                request = pb.GenerateRequest(
                    model=TINY_RANDOM_MODEL_NAME,
                    prompt=" ".join(f"word{i}x{n}" for n in range(150)),
                    sampling=pb.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                )
                try:
                    chunks = list(daemon.generation.Generate(request, timeout=120))
                    results.append(chunks[-1].usage.completion_tokens)
                except Exception as error:  # noqa: BLE001 (any failure is what the assertion reports)
                    failures.append(repr(error))

        threads = [threading.Thread(target=keep_prefilling, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()

        def three_serving() -> pb.GetLoadResponse | None:  # the load as the autoscaler's answer to it stands
            loads = daemon.admin.GetLoad(pb.GetLoadRequest())
            return loads if [s.state for s in loads.schedulers] == ["serving"] * 3 else None

        try:
            # Read while the load lasts: once it stops, the extra worker may drain before the threads are joined.
            loads = daemon.wait_for(three_serving, timeout=180)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=180)
        assert failures == [] and results and set(results) == {4}
        assert sorted(s.role for s in loads.schedulers) == ["decode", "prefill", "prefill"]
        assert {d.role for d in loads.autoscale} == {"decode", "prefill"}
        # Quiet: the extra prefill worker drains and retires; the decode worker serves on throughout.
        daemon.wait_for(lambda: len(_states(daemon)) == 2, timeout=150 + QUIET_DELAY_S)  # the extra one retired
        assert _states(daemon)[decode] == "serving" and daemon.log_entries("worker_retired")
        assert decode not in {e["worker"] for e in daemon.log_entries("worker_retired")}
        assert daemon.metric("tokend:desired_replicas", model_name=TINY_RANDOM_MODEL_NAME, role="prefill") == 1


def test_a_declared_peak_holds_a_warm_prefill_worker_on_the_spare_prefill_group():
    """With prefill and decode pools, the prefill pool holds warm capacity for the declared peak too (its share of
    it: the long prompts'), so a burst of long prompts is served by a promotion rather than a cold start."""
    flags = ["--model", TINY_RANDOM_MODEL_NAME, "--device", "cpu=prefill,cpu=decode", "--spare-devices", "cpu=prefill",
             "--disagg-min-prompt-tokens", "16", "--autoscale-max-workers", "2",
             "--autoscale-peak-rps", "1000"]  # fmt: skip
    with Daemon(*flags) as daemon:
        # No step time measured yet: a declared peak holds all the ceiling allows, which for the prefill pool is
        # the spare prefill group; the decode pool has no spare group to hold one on.
        daemon.wait_for(lambda: sorted(_states(daemon).values()) == ["serving", "serving", "standby"], timeout=120)
        loads = daemon.admin.GetLoad(pb.GetLoadRequest())
        (standby,) = [s for s in loads.schedulers if s.state == "standby"]
        assert standby.role == "prefill"
        decisions = {d.role: d for d in loads.autoscale}
        assert decisions["prefill"].desired_standby == 1 and decisions["prefill"].peak_requests_per_second == 1000


def test_with_no_spare_group_the_decision_is_exported_for_an_hpa_rising_with_a_burst_and_falling_after():
    """A one-worker pod (no spare groups, no --autoscale-max-workers) scales nothing itself, but still exports what
    its load needs, for KEDA or an HPA across pods: more than this pod under a burst, and back to this pod once quiet
    for the delay (the slow loop's forecast of the burst's rate holds it there; with no load for the forecast's
    history it goes to 0: its share fits on the other pods). Nothing is started or promoted in the box."""
    flags = ["--model", TINY_RANDOM_MODEL_NAME, "--max-num-seqs", "4", "--interactive-ttft-target", "30",
             "--autoscale-scale-down-delay", str(QUIET_DELAY_S)]  # fmt: skip
    with Daemon(*flags) as daemon:
        daemon.wait_for(lambda: _desired(daemon) == 1, timeout=60)
        until = threading.Event()
        threads, results, failures = _burst(daemon, max_tokens=200, until=until)
        daemon.wait_for(lambda: _desired(daemon) >= 2, timeout=60)  # the queue passes the pod's slots
        _end(threads, until)
        assert failures == [] and set(results) == {("length", 200)}
        daemon.wait_for(lambda: _desired(daemon) == 1, timeout=60 + QUIET_DELAY_S)
        assert list(_states(daemon).values()) == ["serving"]
        assert daemon.log_entries("worker_starting") == [] and daemon.log_entries("worker_promoted") == []
