"""Runs a handler over `count` values that hypothesis generates from a strategy, reproducibly from a seed."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import strategies as st


def run_examples(strategy: st.SearchStrategy, count: int, seed: int, handle: Callable[[object], None]) -> None:
    """Calls handle(value) for up to `count` generated values (fewer only if hypothesis runs out of distinct ones).

    Generation only: no example database, no shrinking, no deadline, no health checks. The handler records what
    it finds instead of failing, so that one bad outcome never stops the run."""
    if count <= 0:
        return

    @settings(
        max_examples=count,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
        report_multiple_bugs=False,
    )
    @hypothesis.seed(seed)
    @given(strategy)
    def run(value: object) -> None:
        handle(value)

    run()
