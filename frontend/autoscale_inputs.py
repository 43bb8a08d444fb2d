"""What the autoscaler's slow loop learns from: each model's recent arrivals (their prompt and output sizes, in an
incremental frontend.arrival_window), and
its workers' step times, as (tokens per step, milliseconds per step) samples taken from consecutive load reports.

A load report carries cumulative counts (steps by size, tokens, mean step time), so the difference between two
reports is the mean step of the steps between them: one sample per report, whatever the step rate.
"""

from __future__ import annotations

import collections

from common.autoscale_policy import StepCost, fit_step_model
from frontend.arrival_window import ArrivalWindow
from gpu_runtime.ipc.messages import LoadReport

_SAMPLES_KEPT = 512
_COLD_STEPS = 4  # a worker's first samples (warm-up, first allocations) are left out of the fit
_MIN_SAMPLES = 8


class AutoscaleInputs:
    def __init__(self, history_s: float, window_s: float, peak_memory_s: float, min_long_prompt: int = 0):
        self._history_s = history_s
        self._window_s, self._peak_memory_s = window_s, peak_memory_s
        self._min_long_prompt = min_long_prompt  # a prefill pool's prompts: disagg_min_prompt_tokens
        self._arrivals: dict[str, ArrivalWindow] = {}
        self._window_counts: dict[str, dict[int, int]] = {}  # model -> arrivals per window, kept for peak memory
        self._samples: dict[str, collections.deque[tuple[int, float]]] = {}
        self._previous: dict[str, LoadReport] = {}  # worker id -> its latest report
        self._seen: collections.Counter[str] = collections.Counter()  # worker id -> samples taken from it

    def request_finished(self, model: str, arrived: float, prompt_tokens: int, output_tokens: int) -> None:
        if model not in self._arrivals:
            self._arrivals[model] = ArrivalWindow(self._history_s, self._min_long_prompt)
        self._arrivals[model].add(arrived, prompt_tokens, output_tokens)
        counts = self._window_counts.setdefault(model, {})
        window = int(arrived // self._window_s)
        if window not in counts:  # a new window: the ones past the peak memory go
            oldest = (arrived - self._peak_memory_s) // self._window_s
            for stale in [w for w in counts if w < oldest]:
                del counts[stale]
        counts[window] = counts.get(window, 0) + 1

    def window_counts(self, model: str) -> dict[int, int]:
        """Arrivals per forecast window (index: arrival time // window) over the peak memory."""
        return self._window_counts.get(model, {})

    def window(self, model: str) -> ArrivalWindow:
        """The model's recent arrivals (those within the history of the newest), kept for a tick to read at once."""
        return self._arrivals.get(model) or ArrivalWindow(self._history_s, self._min_long_prompt)

    def arrivals(self, model: str) -> list[tuple[float, int, int]]:
        """The same, listed in time order (a copy: for a test or the simulator, not for every tick)."""
        return list(self._arrivals.get(model, ()))

    def load_reported(self, model: str, worker_id: str, report: LoadReport) -> None:
        previous = self._previous.get(worker_id)
        self._previous[worker_id] = report
        if previous is None or previous.incarnation != report.incarnation:
            return
        steps = sum(report.iteration_token_counts) - sum(previous.iteration_token_counts)
        if steps <= 0:
            return
        milliseconds = report.mean_step_ms * sum(report.iteration_token_counts) - previous.mean_step_ms * sum(
            previous.iteration_token_counts
        )
        tokens = report.iteration_tokens_sum - previous.iteration_tokens_sum
        self._seen[worker_id] += 1
        if self._seen[worker_id] > _COLD_STEPS and milliseconds > 0:
            samples = self._samples.setdefault(model, collections.deque(maxlen=_SAMPLES_KEPT))
            samples.append((round(tokens / steps), milliseconds / steps))

    def step_model(self, model: str) -> StepCost | None:
        """The fitted step-time model, or None until there are enough samples of different step sizes."""
        samples = list(self._samples.get(model, ()))
        if len(samples) < _MIN_SAMPLES:
            return None
        try:
            return fit_step_model(samples)
        except ValueError:  # every step the same size: no slope yet
            return None
