"""A model's recent arrivals, kept so that a tick reads them without rescanning them all: per-second slots in a deque
trimmed from the left, each with its sorted times and its token sums, plus running totals over the whole window.

The autoscaler's slow loop wants, each tick and for each pool: the arrival rate per forecast window over the history
(counted relative to now), the mean request size of those arrivals and of all kept, and a prefill pool's share of
them (its long prompts). A full scan made that O(arrivals) on the event loop every tick (~0.3 s at 200 req/s); here a
tick visits each second's slot once and bisects or scans only the two slots at the edges of its ranges.
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

Arrival = tuple[float, int, int]  # (time, prompt tokens, output tokens)


@dataclass(slots=True)
class _Tally:
    count: int = 0
    prompt: int = 0
    output: int = 0

    def add(self, prompt: int, output: int, sign: int = 1) -> None:
        self.count += sign
        self.prompt += sign * prompt
        self.output += sign * output


@dataclass(slots=True)
class _Second:
    """The arrivals of one second, sorted by time, with the sums of all and of the long prompts among them."""

    second: int
    times: list[float] = field(default_factory=list)
    items: list[Arrival] = field(default_factory=list)
    all: _Tally = field(default_factory=_Tally)
    long: _Tally = field(default_factory=_Tally)  # prompts of min_long_prompt tokens or more, one output token each


@dataclass(frozen=True, slots=True)
class PoolArrivals:
    """What one pool's forecast and capacity read of the window at one tick."""

    rates: list[float]  # arrivals/s in each forecast window of the history, oldest first, the last ending now
    recent_prompt: float  # mean prompt and output tokens of the arrivals in those windows (0 with none)
    recent_output: float
    num_recent: int
    mean_prompt: float  # over every arrival kept (0 with none): a worker's capacity is sized by them
    mean_output: float
    num_kept: int
    share: float  # the pool's share of all arrivals kept (1 for the routed pool, and before any arrival)


class ArrivalWindow:
    def __init__(self, history_s: float, min_long_prompt: int = 0):
        self._history_s = history_s
        self._min_long = min_long_prompt
        self._seconds: collections.deque[_Second] = collections.deque()
        self._all, self._long = _Tally(), _Tally()
        self._newest = -math.inf

    @classmethod
    def of(cls, arrivals: Iterable[Arrival], history_s: float = math.inf, min_long_prompt: int = 0) -> ArrivalWindow:
        window = cls(history_s, min_long_prompt)
        for arrival in arrivals:
            window.add(*arrival)
        return window

    def __len__(self) -> int:
        return self._all.count

    def __iter__(self):
        for second in self._seconds:
            yield from second.items

    def add(self, arrived: float, prompt: int, output: int) -> None:
        """One arrival (they come as requests finish: mostly, not quite, in time order); those more than the
        history before the newest go."""
        self._newest = max(self._newest, arrived)
        if arrived < self._newest - self._history_s:
            return
        slot = self._slot(math.floor(arrived))
        index = bisect.bisect_right(slot.times, arrived)
        slot.times.insert(index, arrived)
        slot.items.insert(index, (arrived, prompt, output))
        self._count(slot, prompt, output, 1)
        self.trim(self._newest - self._history_s)

    def trim(self, oldest: float) -> None:
        """Forgets the arrivals before `oldest`: whole seconds from the left, then the edge second's first ones."""
        while self._seconds and self._seconds[0].second + 1 <= oldest:
            for _, prompt, output in self._seconds.popleft().items:
                self._count(None, prompt, output, -1)
        if self._seconds:
            first = self._seconds[0]
            cut = bisect.bisect_left(first.times, oldest)
            for _, prompt, output in first.items[:cut]:
                self._count(first, prompt, output, -1)
            del first.times[:cut], first.items[:cut]

    def pool(self, now: float, num_windows: int, width: float, prefill: bool) -> PoolArrivals:
        """The rates and sizes a pool's decision reads: every arrival for the routed pool, the long prompts (one
        output token each: the prefill worker samples the first) for the prefill pool."""
        start = now - num_windows * width
        rates = [self._count_between(start + i * width, start + (i + 1) * width, prefill) / width
                 for i in range(num_windows)]  # fmt: skip
        rates[-1] += self._count_between(now, now, prefill, inclusive=True) / width  # an arrival at now itself
        recent = self._tally_between(start, now, prefill)
        kept = self._long if prefill else self._all
        share = kept.count / self._all.count if prefill and self._all.count else 1.0
        return PoolArrivals(rates, _mean(recent.prompt, recent.count), _mean(recent.output, recent.count),
                            recent.count, _mean(kept.prompt, kept.count), _mean(kept.output, kept.count), kept.count,
                            share)  # fmt: skip

    # -- inside --------------------------------------------------------------------------------------------

    def _slot(self, second: int) -> _Second:
        if not self._seconds or second > self._seconds[-1].second:
            self._seconds.append(_Second(second))
            return self._seconds[-1]
        for index in range(len(self._seconds) - 1, -1, -1):  # a late finisher: a slot near the right end
            slot = self._seconds[index]
            if slot.second == second:
                return slot
            if slot.second < second:
                self._seconds.insert(index + 1, _Second(second))
                return self._seconds[index + 1]
        self._seconds.appendleft(_Second(second))
        return self._seconds[0]

    def _count(self, slot: _Second | None, prompt: int, output: int, sign: int) -> None:
        is_long = prompt >= self._min_long
        for tally in (self._all, slot.all if slot else None):
            if tally is not None:
                tally.add(prompt, output, sign)
        if is_long:
            for tally in (self._long, slot.long if slot else None):
                if tally is not None:
                    tally.add(prompt, 1, sign)

    def _count_between(self, low: float, high: float, long: bool, inclusive: bool = False) -> int:
        """Arrivals with low <= time < high (time == high with `inclusive`): whole seconds by their tallies,
        the edge seconds by bisecting (or, for long prompts, looking at) their times."""
        total = 0
        for slot in self._seconds_overlapping(low, high):
            if slot.second >= low and slot.second + 1 <= high and not inclusive:
                total += (slot.long if long else slot.all).count
                continue
            first = bisect.bisect_left(slot.times, low)
            last = bisect.bisect_right(slot.times, high) if inclusive else bisect.bisect_left(slot.times, high)
            if long:
                total += sum(1 for _, prompt, _ in slot.items[first:last] if prompt >= self._min_long)
            else:
                total += last - first
        return total

    def _tally_between(self, low: float, high: float, long: bool) -> _Tally:
        """The tally of the arrivals with low <= time <= high."""
        tally = _Tally()
        for slot in self._seconds_overlapping(low, high):
            if slot.second >= low and slot.second + 1 <= high:
                whole = slot.long if long else slot.all
                tally.count, tally.prompt, tally.output = (tally.count + whole.count, tally.prompt + whole.prompt,
                                                           tally.output + whole.output)  # fmt: skip
                continue
            first, last = bisect.bisect_left(slot.times, low), bisect.bisect_right(slot.times, high)
            for _, prompt, output in slot.items[first:last]:
                if not long:
                    tally.add(prompt, output)
                elif prompt >= self._min_long:
                    tally.add(prompt, 1)
        return tally

    def _seconds_overlapping(self, low: float, high: float):
        for slot in self._seconds:  # a few hundred slots at most: the history's seconds
            if slot.second > high:
                return
            if slot.second + 1 > low:
                yield slot


def _mean(total: int, count: int) -> float:
    return total / count if count else 0.0
