"""IterationTokens: vLLM's iteration_tokens_total (tokens per engine step), from the schedulers' own counts.

A histogram of steps needs one observation per step, and only the scheduler sees its steps: each counts them per
bucket and its load reports carry the running totals, which this collector sums and serves as a histogram.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gpu_runtime.ipc.messages import ITERATION_TOKEN_BUCKETS, LoadReport

_NAME = "tokend:iteration_tokens_total"
_HELP = "Tokens computed per engine step (prompt chunks plus decodes)"


class IterationTokens(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()  # reports arrive on the event loop, scrapes on the metrics threads
        # Per (model_name, group): the latest report's counts, and what earlier incarnations of that scheduler
        # counted before they restarted (so the series never goes down).
        self._latest: dict[tuple[str, str], tuple[str, list[int], int]] = {}
        self._retired: dict[tuple[str, str], tuple[list[int], int]] = {}

    def observe(self, labels: tuple[str, str], report: LoadReport) -> None:
        counts = report.iteration_token_counts
        if len(counts) != len(ITERATION_TOKEN_BUCKETS) + 1:
            return  # a scheduler that does not count (or counts other buckets) has nothing to add
        with self._lock:
            latest = self._latest.get(labels)
            if latest is not None and latest[0] != report.incarnation:
                retired_counts, retired_sum = self._retired.get(labels, ([0] * len(counts), 0))
                self._retired[labels] = ([a + b for a, b in zip(retired_counts, latest[1], strict=True)],
                                         retired_sum + latest[2])  # fmt: skip
            self._latest[labels] = (report.incarnation, list(counts), report.iteration_tokens_sum)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(_NAME, _HELP, labels=["model_name", "group"])
        with self._lock:
            for labels, (_, counts, total) in self._latest.items():
                retired_counts, retired_sum = self._retired.get(labels, ([0] * len(counts), 0))
                cumulative, buckets = 0, []
                for bound, latest, retired in zip(
                    [*map(floatToGoString, ITERATION_TOKEN_BUCKETS), "+Inf"], counts, retired_counts, strict=True
                ):
                    cumulative += latest + retired
                    buckets.append((bound, cumulative))
                family.add_metric(list(labels), buckets, total + retired_sum)
        yield family

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(_NAME, _HELP, labels=["model_name", "group"])]
