"""The model's tokenizer (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

_CUT_SLACK = 16  # tokens the pieces of a text may have beyond the whole's, a cut: the word at it split differently
_MAX_PIECE_CHARS = 64 * 1024  # a piece's encoding (tokens, offsets, strings) a few megabytes at most


class TooManyTokens(ValueError):
    def __init__(self, num_tokens: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{num_tokens} tokens")
        self.num_tokens = num_tokens
        self.exact = exact  # False: counted on part of the text, the whole has more


class Tokenizer:
    """Text to token ids and back, with the special tokens the checkpoint's post-processor adds."""

    def __init__(self, model_dir: str | Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model: {model_dir} has no tokenizer.json")
        self._tokenizer = _HFTokenizer.from_file(str(path))

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers` object itself (incremental decoding streams need it)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of the text; chat prompts pass add_special_tokens=False (their template wrote the BOS).
        Raises TooManyTokens when there are more than max_tokens, having tokenized at most about twice that many.

        Through encode_batch on purpose: unlike `encode`, it releases the GIL while the Rust tokenizer runs, so a
        prompt tokenized on a worker thread does not stall the caller's event loop. What does hold the GIL is
        freeing the result (~40 ns a token) and listing its ids: hence counts first, on bounded pieces."""
        if max_tokens is not None:
            self._refuse_if_far_longer(text, add_special_tokens, max_tokens)
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    def _refuse_if_far_longer(self, text: str, add_special_tokens: bool, max_tokens: int) -> None:
        """Counts the tokens of the text piece by piece, each cut before a space, and raises TooManyTokens once the
        count is clearly past max_tokens: a text of megabytes is refused after tokenizing a little more than
        max_tokens tokens, one piece's encoding in memory at a time.

        A piece cut before a space splits into the same words as the whole text there, so the pieces' counts add
        up to the whole's but for a few tokens around each cut: less _CUT_SLACK a cut, the sum is a lower bound."""
        piece_chars = max(1024, max_tokens // 4)  # a character is at most four byte-level tokens
        if len(text) <= piece_chars:
            return
        piece_chars = min(piece_chars, _MAX_PIECE_CHARS)
        counted = start = num_cuts = 0
        while start < len(text):
            end = start + piece_chars
            if end < len(text):
                cut = text.rfind(" ", start + piece_chars // 2, end)
                end, num_cuts = (cut if cut > 0 else end), num_cuts + 1
            special = add_special_tokens and start == 0  # the BOS (and whatever else is added) once
            counted += len(self._tokenizer.encode_batch([text[start:end]], add_special_tokens=special)[0])
            start = end
            if counted - _CUT_SLACK * num_cuts > max_tokens:
                raise TooManyTokens(counted - _CUT_SLACK * num_cuts, exact=False)

    def token_text(self, token_id: int) -> str:
        """One token on its own as text, special tokens included (for logprobs)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
