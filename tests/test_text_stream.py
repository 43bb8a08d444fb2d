"""Incremental detokenization and stop strings: chunks add up to the full decode, cut at the first stop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.text_stream import IncrementalDetokenizer, StopStringMatcher
from gpu_runtime.default_model import ensure_tiny_random_model
from gpu_runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(ensure_tiny_random_model())


def _stream(tokenizer, token_ids: list[int], sizes: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer.backend)
    pieces, start = [], 0
    for size in sizes:
        if start >= len(token_ids):
            break
        pieces.append(detokenizer.push(token_ids[start : start + size]))
        start += size
    if start < len(token_ids):
        pieces.append(detokenizer.push(token_ids[start:]))
    pieces.append(detokenizer.finish())
    return pieces


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(max_size=40),
    noise=st.lists(st.integers(0x80, 0xFF), max_size=4),
    sizes=st.lists(st.integers(1, 4), max_size=40),
)
def test_chunks_concatenate_to_the_full_decode(tokenizer, text, noise, sizes):
    # Real text, then stray UTF-8 continuation bytes (a random model emits those), then text again.
    token_ids = tokenizer.encode(text)[1:] + noise + tokenizer.encode(text[::-1])[1:]
    assert "".join(_stream(tokenizer, token_ids, sizes)) == tokenizer.decode(token_ids)


def test_a_multi_byte_character_appears_once_it_is_complete(tokenizer):
    token_ids = tokenizer.encode("日")[1:]
    assert len(token_ids) == 3
    detokenizer = IncrementalDetokenizer(tokenizer.backend)
    assert [detokenizer.push([t]) for t in token_ids] == ["", "", "日"]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
    sizes=st.lists(st.integers(0, 5), max_size=30),
)
def test_stop_strings_cut_the_text_at_the_first_match_across_chunks(text, stop, sizes):
    """Generation stops at the first chunk after which a stop string appears (as a model stops at the step that
    completes one), and the text is cut where the earliest stop string there begins."""
    matcher = StopStringMatcher(stop)
    emitted, start, so_far, expected = [], 0, "", None
    for size in [*sizes, len(text)]:
        chunk = text[start : start + size]
        start += size
        emitted.append(matcher.push(chunk))
        so_far += chunk
        hits = [so_far.find(s) for s in stop if s in so_far]
        if expected is None and hits:
            expected = so_far[: min(hits)]
    emitted.append(matcher.flush())
    assert "".join(emitted) == (text if expected is None else expected)
    assert (matcher.matched is not None) == (expected is not None)
