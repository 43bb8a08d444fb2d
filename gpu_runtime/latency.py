"""Latency targeting: a step-time model learned from measured steps, and the budgets it implies.

The model is linear in what a step computes, t = a + b * tokens + c * sequences, fitted by least squares
over a sliding window of recent steps (so it follows the machine's drift). From it the scheduler derives
  - the token budget: the most tokens a step may take while running streams keep `itl_slo_ms`;
  - the batch depth: the most running sequences that still leave enough prefill capacity per step for the
    next prompt to reach its first token within `ttft_slo_ms`, and whose decode step keeps `itl_slo_ms`;
  - a projected time-to-first-token for every waiting request, the leading indicator for admission and
    autoscaling.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from gpu_runtime.engine_config import SchedulerConfig

_MIN_SAMPLES = 8  # steps seen before the model is trusted; until then the configured maxima apply
_WINDOW = 512
_REFIT_EVERY = 16


class StepTimeModel:
    """Predicts a step's seconds from its scheduled tokens and sequences."""

    def __init__(self) -> None:
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=_WINDOW)
        self._since_fit = 0
        self.coefficients: tuple[float, float, float] | None = None  # (a, b, c) once warm

    @property
    def is_warm(self) -> bool:
        return self.coefficients is not None

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        self._samples.append((num_tokens, num_seqs, seconds))
        self._since_fit += 1
        if len(self._samples) >= _MIN_SAMPLES and (self.coefficients is None or self._since_fit >= _REFIT_EVERY):
            self._fit()

    def _fit(self) -> None:
        data = np.asarray(self._samples, dtype=np.float64)
        features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        # A little ridge keeps the fit stable when tokens and sequences move together (pure decode).
        ridge = 1e-9 * np.eye(3)
        solution = np.linalg.solve(features.T @ features + ridge, features.T @ data[:, 2])
        # Costs cannot be negative; a negative coefficient is noise in a poorly excited direction.
        a, b, c = (max(0.0, float(x)) for x in solution)
        if b == 0.0 and c == 0.0:
            b = float(np.mean(data[:, 2] / np.maximum(data[:, 0], 1)))
        self.coefficients = (a, b, c)
        self._since_fit = 0

    @property
    def seconds_per_token(self) -> float:
        """What one more token in a step costs (0 until the model is fitted)."""
        return self.coefficients[1] if self.coefficients is not None else 0.0

    def predict(self, num_tokens: int, num_seqs: int) -> float:
        a, b, c = self.coefficients or (0.0, 0.0, 0.0)
        return a + b * num_tokens + c * num_seqs

    def max_tokens_within(self, seconds: float, num_seqs: int) -> int:
        """The most tokens a step with `num_seqs` sequences may compute and still take <= `seconds`."""
        a, b, c = self.coefficients or (0.0, 0.0, 0.0)
        if b <= 0:
            return 1 << 30
        return max(0, int((seconds - a - c * num_seqs) / b))


def prefill_seconds(model: StepTimeModel, token_budget: int, num_decodes: int, prompt_tokens: int) -> float:
    """Seconds until `prompt_tokens` are prefilled in steps that also carry `num_decodes` running decodes: full
    steps at the token budget, then one partial step, each as long as the model predicts. The time-to-first-token
    projection every waiting request gets (the scheduler's) and the autoscaling simulator's workers."""
    per_step = max(1, token_budget - num_decodes)
    full_steps, rest = divmod(prompt_tokens, per_step)
    seconds = full_steps * model.predict(token_budget, num_decodes + 1)
    if rest:
        seconds += model.predict(rest + num_decodes, num_decodes + 1)
    return seconds


@dataclass(frozen=True, slots=True)
class StepPlan:
    token_budget: int  # tokens this step may compute
    max_running: int  # sequences the running batch may hold after admission


class LatencyPolicy:
    """Turns the targets and the step-time model into each step's budget and batch depth."""

    def __init__(self, config: SchedulerConfig, min_chunk: int):
        self.targets = config  # ttft_slo_ms and itl_slo_ms
        self.max_tokens = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.min_chunk = min_chunk  # prefill always advances by at least this much per step
        self.model = StepTimeModel()

    def plan(self, num_running: int, next_prompt_tokens: int) -> StepPlan:
        if not self.model.is_warm:
            return StepPlan(self.max_tokens, self.max_seqs)
        return StepPlan(self.token_budget(num_running), self._max_depth(next_prompt_tokens))

    def token_budget(self, num_seqs: int) -> int:
        if self.targets.itl_slo_ms is None:
            return self.max_tokens
        within = self.model.max_tokens_within(self.targets.itl_slo_ms / 1e3, num_seqs)
        return max(num_seqs + self.min_chunk, min(self.max_tokens, within))

    def _max_depth(self, next_prompt_tokens: int) -> int:
        """The deepest batch (number of running sequences) that keeps both targets, at least one."""
        depth = 1
        for candidate in range(1, self.max_seqs + 1):
            if not self._depth_keeps_targets(candidate, next_prompt_tokens):
                break
            depth = candidate
        return depth

    def _depth_keeps_targets(self, depth: int, next_prompt_tokens: int) -> bool:
        itl = self.targets.itl_slo_ms
        if itl is not None and self.model.predict(depth, depth) * 1e3 > itl:
            return False
        if self.targets.ttft_slo_ms is None or next_prompt_tokens == 0:
            return True
        return self.projected_prefill_seconds(depth, next_prompt_tokens) * 1e3 <= self.targets.ttft_slo_ms

    def projected_prefill_seconds(self, num_running: int, prompt_tokens: int) -> float:
        """Seconds to prefill `prompt_tokens` while `num_running` streams decode beside it."""
        budget = self.token_budget(num_running + 1)
        per_step = max(1, budget - num_running)
        steps = math.ceil(prompt_tokens / per_step)
        return steps * self.model.predict(min(budget, num_running + prompt_tokens), num_running + 1)
