"""The model's tokenizer (tokenizer.json through the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of the text; chat prompts pass add_special_tokens=False (their template wrote the BOS)."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> str:
        """One token on its own as text, special tokens included (for logprobs)."""
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)
