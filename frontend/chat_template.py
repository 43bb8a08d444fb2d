"""Renders a conversation into prompt text with the model's chat template (tokenizer_config.json).

Templates run in jinja2's immutable sandbox (no attribute tricks, no mutation of the messages), on a worker
thread with a time limit, so that a pathological template or conversation cannot stall the frontend's loop.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_TIMEOUT_S = 1.0
MAX_MESSAGES = 256


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; the message names the field ("messages")."""


class ChatTemplate:
    def __init__(self, template: str, special_tokens: dict[str, str]):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise_exception
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = environment.from_string(template)
        self._special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The model's template, or None when tokenizer_config.json has none."""
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one serves chat
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            return None
        special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return cls(template, special)

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special_tokens)
        except TemplateError as error:
            raise ChatTemplateError(f"messages: the model's chat template refused them: {error}") from None

    async def render_async(self, messages: list[dict[str, str]], timeout: float = RENDER_TIMEOUT_S) -> str:
        """Renders on a worker thread; past the timeout the request fails at once (the thread runs on to its end:
        Python cannot stop it, which is why conversations are bounded in size and count)."""
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.render, messages), timeout)
        except TimeoutError:
            raise ChatTemplateError(f"messages: rendering the chat template took over {timeout} s") from None


def _raise_exception(message: str):
    raise TemplateError(message)


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""
