"""Turns a request's token stream into text chunks: incremental detokenization, then stop strings.

The concatenated chunks equal a full decode of the tokens, cut before the first stop string if one matched.
"""

from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer


class IncrementalDetokenizer:
    """Decodes tokens as they arrive, as TGI and vLLM do: decode a short window of recent tokens and emit
    what it adds, holding back while the window ends in U+FFFD (a character still missing its last bytes)."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # the window starts here: context that shapes how the next tokens decode
        self._read_offset = 0  # tokens before this are emitted
        self._emitted_chars = 0

    def push(self, token_ids: list[int]) -> str:
        self._token_ids.extend(token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._token_ids)
        text = window_text[len(prefix_text) :]
        self._emitted_chars += len(text)
        return text

    def finish(self) -> str:
        """The text still held back; with it, the chunks add up to a full decode of every token."""
        full = self._decode(self._token_ids)
        return full[self._emitted_chars :]

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Holds back just enough text to see a stop string that spans chunks, and cuts the text at the first one."""

    def __init__(self, stop: list[str]):
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) - 1 for s in self._stop), default=0)
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Returns the text that is safe to emit now; after a match, the text before it and nothing more."""
        if self.matched is not None:
            return ""
        self._pending += text
        first = min(
            ((index, stop) for stop in self._stop if (index := self._pending.find(stop)) >= 0),
            default=None,
        )
        if first is not None:
            index, self.matched = first
            safe, self._pending = self._pending[:index], ""
            return safe
        cut = len(self._pending) - self._hold
        if cut <= 0:
            return ""
        safe, self._pending = self._pending[:cut], self._pending[cut:]
        return safe

    def flush(self) -> str:
        """At the end of the stream, what was held back (it can no longer start a stop string)."""
        rest, self._pending = self._pending, ""
        return "" if self.matched is not None else rest
