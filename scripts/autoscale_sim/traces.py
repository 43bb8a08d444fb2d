"""The three arrival traces, seeded: (time, prompt tokens, output tokens) in time order.

  step_burst      1 req/s, then 8 req/s from 1/5 of the duration for 2/5 of it, then 1 req/s again.
  sinusoid        1 -> 8 -> 1 req/s, a period of 1/3 of the duration.
  bursty_poisson  a two-state Markov-modulated Poisson process: 1.5 req/s quiet spells (mean 1/10 of the duration)
                  and 8 req/s bursts (mean 1/30 of it), the switches exponentially distributed.

Prompt and output lengths are log-normal around --prompt-tokens and --output-tokens (sigma 0.5), clipped to
[16, 4x] and [4, 4x].
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

TRACES = ("step_burst", "sinusoid", "bursty_poisson")
LOW, HIGH = 1.0, 8.0


def rate_function(name: str, duration_s: float, rng: random.Random) -> Callable[[float], float]:
    if name == "step_burst":
        return lambda t: HIGH if duration_s / 5 <= t < 3 * duration_s / 5 else LOW
    if name == "sinusoid":
        period = duration_s / 3
        return lambda t: LOW + (HIGH - LOW) * (1 - math.cos(2 * math.pi * t / period)) / 2
    if name == "bursty_poisson":
        switches, t, burst = [], 0.0, False
        while t < duration_s:
            t += rng.expovariate(1 / (duration_s / 30 if burst else duration_s / 10))
            burst = not burst
            switches.append((t, burst))

        def rate(at: float) -> float:
            state = False
            for when, now_burst in switches:
                if when > at:
                    break
                state = now_burst
            return HIGH if state else 1.5

        return rate
    raise ValueError(f"trace: expected one of {', '.join(TRACES)}, got {name!r}")


def make_trace(name: str, duration_s: float, prompt_tokens: int, output_tokens: int, seed: int):
    """Poisson arrivals at the trace's rate (by thinning a HIGH-rate process)."""
    rng = random.Random(f"{name}:{seed}")
    rate = rate_function(name, duration_s, rng)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(HIGH)
        if t >= duration_s:
            return arrivals
        if rng.random() * HIGH < rate(t):
            prompt = draw_length(rng, prompt_tokens, 16)
            output = draw_length(rng, output_tokens, 4)
            arrivals.append((t, prompt, output))


def draw_length(rng: random.Random, median: int, low: int) -> int:
    """Log-normal around `median` (sigma 0.5), clipped to [low, 4 * median]."""
    return max(low, min(4 * median, round(median * math.exp(rng.gauss(0, 0.5)))))
