"""The model's tokenizer (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

_PREFIX_SLACK = 16  # tokens a prefix may have beyond the whole text's, from re-splitting the word at its cut


class TooManyTokens(ValueError):
    def __init__(self, num_tokens: int, exact: bool = True):
        super().__init__(f"{'' if exact else 'at least '}{num_tokens} tokens")
        self.num_tokens = num_tokens
        self.exact = exact  # False: counted on a prefix, the whole text has more


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
        freeing the result (~40 ns a token) and listing its ids: hence counts first, on bounded prefixes."""
        if max_tokens is not None:
            self._refuse_if_far_longer(text, add_special_tokens, max_tokens)
        encoding = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    def _refuse_if_far_longer(self, text: str, add_special_tokens: bool, max_tokens: int) -> None:
        """Counts the tokens of doubling prefixes of the text, cut at a space, and raises TooManyTokens once one
        has clearly more than max_tokens: a text of megabytes is refused after tokenizing about twice the limit.

        A prefix cut before a space splits into the same words as the whole text up to there, so it never has
        more tokens than the whole but for a few around the cut: _PREFIX_SLACK."""
        length = max(1024, max_tokens // 4)  # a character can be several byte-level tokens (an emoji, four)
        while length < len(text):
            cut = text.rfind(" ", length // 2, length)
            prefix = text[: cut if cut > 0 else length]
            num_tokens = len(self._tokenizer.encode_batch([prefix], add_special_tokens=add_special_tokens)[0])
            if num_tokens > max_tokens + _PREFIX_SLACK:
                raise TooManyTokens(num_tokens, exact=False)
            length *= 2

    def token_text(self, token_id: int) -> str:
        """One token on its own as text, special tokens included (for logprobs)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
