"""tokend:iteration_tokens_total: the schedulers' per-step counts, summed into one histogram that never goes down
when a scheduler restarts and counts from zero again."""

from __future__ import annotations

import msgspec
from exposition import total
from prometheus_client import CollectorRegistry, generate_latest

from frontend.iteration_tokens import IterationTokens
from gpu_runtime.ipc.messages import ITERATION_TOKEN_BUCKETS, LoadReport

LABELS = ("tiny", "0")


def report(incarnation: str, steps: dict[int, int], tokens: int) -> LoadReport:
    """A load report whose scheduler counted `steps[i]` steps in bucket i, `tokens` tokens in all."""
    counts = [steps.get(index, 0) for index in range(len(ITERATION_TOKEN_BUCKETS) + 1)]
    return LoadReport("tiny/0", incarnation, 0, 0, 0, 0.0, 1, 0, 0, 0, 0, 0.0, 0.0, 0.0,
                      iteration_token_counts=counts, iteration_tokens_sum=tokens)  # fmt: skip


def scrape(collector: IterationTokens) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_buckets_are_cumulative_and_the_latest_report_counts():
    collector = IterationTokens()
    collector.observe(LABELS, report("a", {0: 2}, 2))
    collector.observe(LABELS, report("a", {0: 3, 1: 1, 13: 1}, 3 + 8 + 20000))
    text = scrape(collector)
    assert total(text, "tokend:iteration_tokens_total_bucket", le="1.0") == 3
    assert total(text, "tokend:iteration_tokens_total_bucket", le="8.0") == 4
    assert total(text, "tokend:iteration_tokens_total_bucket", le="16384.0") == 4
    assert total(text, "tokend:iteration_tokens_total_bucket", le="+Inf") == 5  # one step beyond every bound
    assert total(text, "tokend:iteration_tokens_total_count") == 5
    assert total(text, "tokend:iteration_tokens_total_sum") == 20011


def test_a_restarted_scheduler_adds_to_what_its_predecessor_counted():
    collector = IterationTokens()
    collector.observe(LABELS, report("a", {1: 4}, 20))
    collector.observe(LABELS, report("b", {1: 1}, 5))  # a new incarnation counts from zero
    collector.observe(LABELS, report("b", {1: 2}, 9))
    text = scrape(collector)
    assert total(text, "tokend:iteration_tokens_total_count") == 6
    assert total(text, "tokend:iteration_tokens_total_sum") == 29


def test_a_report_without_counts_adds_nothing():
    collector = IterationTokens()
    collector.observe(LABELS, report("a", {1: 4}, 20))
    collector.observe(LABELS, msgspec.structs.replace(report("a", {}, 0), iteration_token_counts=[]))
    assert total(scrape(collector), "tokend:iteration_tokens_total_count") == 4
