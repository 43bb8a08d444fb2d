"""How large a regex's automaton can get from nested counted repetitions, checked before llguidance sees it.

llguidance builds a regex's automaton lazily, so `(x{1000}){1000}` compiles in a millisecond, costs about a second
on its first mask and fails on its second ("too many expressions constructed"): mid-generation, after the request
was admitted. The product of the repetition counts along a path of nested repeats bounds what such a regex
expands to; past MAX_REPEAT_PRODUCT it is refused up front. Read with Python's own regex parser, which shares the
counted-repetition syntax; a pattern it cannot read (Rust-only syntax such as \\p{L}) is left to llguidance.
"""

from __future__ import annotations

import re
import re._parser as sre_parse
from re._constants import MAXREPEAT

# x{100000} alone costs ~0.1 s on its first mask; (x{1000}){1000} (10x that) fails on its second.
MAX_REPEAT_PRODUCT = 100_000
_REPEATS = (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT)


def repeat_product(pattern: str) -> int:
    """The largest product of counted-repetition bounds along one nesting path (an unbounded repeat counts 1)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return 1
    return _largest(list(parsed))


def _largest(items) -> int:
    best = 1
    for op, value in items:
        if op in _REPEATS:
            low, high, inner = value
            count = low if high == MAXREPEAT else high
            best = max(best, max(count, 1) * _largest(list(inner)))
        elif op is sre_parse.SUBPATTERN:
            best = max(best, _largest(list(value[-1])))
        elif op is sre_parse.BRANCH:
            best = max([best, *(_largest(list(branch)) for branch in value[1])])
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            best = max(best, _largest(list(value[1])))
    return best
