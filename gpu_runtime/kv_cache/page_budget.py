"""How many KV pages one request holds at once: the page math the engine admits by, and the frontend checks requests
against before they reach a scheduler (no imports: the frontend process reads it too, without torch)."""

from __future__ import annotations

from collections.abc import Sequence


def pages_held_at_most(num_tokens: int, page_size: int, windows: Sequence[int | None], max_chunk: int) -> int:
    """The most pages a sequence of `num_tokens` tokens holds at once when a step computes at most `max_chunk` of them,
    its KV groups' together (`windows`: each group's; one group unless the model mixes sliding and global layers):
    all of its pages in a global group, and in a group whose layers slide over a window, those from its window's
    oldest position to the end of a step's chunk (pages behind the window are given back, and skipped by a
    prefix-cache hit)."""
    whole = -(-num_tokens // page_size)
    return sum(whole if window is None else min(whole, -(-(window - 1 + max_chunk) // page_size) + 1)
               for window in windows)  # fmt: skip


def most_tokens_held(num_pages: int, page_size: int, windows: Sequence[int | None], max_chunk: int) -> int:
    """The longest sequence, up to num_pages * page_size tokens, whose pages (pages_held_at_most) fit `num_pages`: all
    of them with one global group, fewer where sliding groups take their window's share of the pool beside it."""
    if pages_held_at_most(1, page_size, windows, max_chunk) > num_pages:
        return 0
    low, high = 1, num_pages * page_size
    while low < high:  # the pages held grow with the length: the longest that fits
        mid = (low + high + 1) // 2
        fits = pages_held_at_most(mid, page_size, windows, max_chunk) <= num_pages
        low, high = (mid, high) if fits else (low, mid - 1)
    return low


def largest_chunk(num_prompt_tokens: int, max_prefill_chunk: int) -> int:
    """The most tokens of one prompt a step computes: `max_prefill_chunk` (chunked prefill's step budget), or the whole
    prompt where it is 0 (prompts are not chunked, or a static batch prefills whole)."""
    return min(num_prompt_tokens, max_prefill_chunk) if max_prefill_chunk else num_prompt_tokens
