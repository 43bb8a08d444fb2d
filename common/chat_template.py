"""Renders a conversation into prompt text with the model's chat template, found and run as `transformers` does.

Where the template comes from (transformers' order): `chat_template.jinja` (and `additional_chat_templates/*.jinja`,
named by file) in the checkpoint directory, else `tokenizer_config.json`'s `chat_template` (a string, or a list of
named templates); `--chat-template PATH` overrides both. With named templates, "tool_use" serves requests that
give tools when the model has one, and "default" serves the rest.

The jinja environment is transformers' own (`utils/chat_template_utils.py`, `_compile_jinja_template`): the
immutable sandbox with trim_blocks/lstrip_blocks, loop controls, a `{% generation %}` tag, a `tojson` that does
not escape HTML, `raise_exception` and `strftime_now`. Templates compile when the model loads, so a broken one
fails the start naming its file; they render on a worker thread with a time limit, so that a pathological
template or conversation cannot stall the frontend's loop, and with a step budget and bounded `*` and `**`, so that
one cannot keep that thread (or the process's memory) after its request has failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The CPU time one render may take, on its own thread: CPU time, not wall time, so that a process stopped or starved
# for a moment (a busy machine, SIGSTOP) does not fail a request whose template did little (the chaos run's stopped
# frontend answered a chat 400). RENDER_WALL_LIMIT_S bounds the wait anyway: no request hangs on a render.
RENDER_TIMEOUT_S = 1.0
RENDER_WALL_LIMIT_S = 30.0
# Template lines one render may execute: real templates take a few thousand for a long conversation; a loop that
# would run for minutes stops here, or at RENDER_TIMEOUT_S of CPU time, whichever comes first.
MAX_RENDER_STEPS = 2_000_000
_CLOCK_EVERY_STEPS = 1024  # how often the step budget reads the thread's CPU clock
MAX_PRODUCT_ITEMS = 1_000_000  # the longest string or list `*` may build in a template ("=" * 80 is the use)
MAX_EXPONENT = 1024
_TEMPLATE_FILENAME = "<template>"  # what jinja names a template compiled from a string
MAX_MESSAGES = 256
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # what transformers' save_pretrained writes
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The names transformers passes to every template (its `special_tokens_map`), when the tokenizer has them.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers marks the end of the message to continue with this, renders, and cuts the rendering there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; the message names the field ("messages")."""


class ChatTemplateLoadError(ValueError):
    """A template does not compile; the message names its file."""


class ChatTemplate:
    def __init__(self, templates: str | dict[str, str], special_tokens: dict[str, str], source: str = "template"):
        """`templates`: one template, or named ones; `source` names where they came from, for load errors."""
        named = {"default": templates} if isinstance(templates, str) else dict(templates)
        self._templates = {name: _compile(text, f"{source} ({name})" if len(named) > 1 else source)
                           for name, text in named.items()}  # fmt: skip
        self._sources = named
        self._special_tokens = special_tokens
        self.source = source

    @property
    def text(self) -> str:
        """Every template's source, joined (what names the model's tool-call format, for one)."""
        return "\n".join(self._sources.values())

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The model's template(s), or None when it has none; ChatTemplateLoadError when one does not compile."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        special = {key: _token_text(config[key]) for key in SPECIAL_TOKENS if config.get(key) is not None}
        if override is not None:
            path = Path(override)
            if not path.is_file():
                raise ChatTemplateLoadError(f"chat_template: {str(path)!r} is not a file")
            return cls(path.read_text(encoding="utf-8"), special, str(path))
        found = _template_files(model_dir)
        if found:
            return cls(found, special, str(model_dir / CHAT_TEMPLATE_FILE))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        if not template:
            return None
        return cls(template, special, str(model_dir / "tokenizer_config.json"))

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        cpu_limit_s: float = RENDER_TIMEOUT_S,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) renders it; ChatTemplateError past
        MAX_RENDER_STEPS template lines or `cpu_limit_s` of this thread's CPU time."""
        template = self._select(tools)
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("messages: continue_final_message and add_generation_prompt exclude each other")
        # None values are dropped as transformers does: templates test for a key, not for None.
        messages = [{key: value for key, value in m.items() if value is not None} for m in messages]
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ChatTemplateError("messages: continue_final_message needs a final message with text content")
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        # A request's kwargs may shadow the special tokens, never the conversation itself.
        variables = {**self._special_tokens, **(template_kwargs or {})}
        variables.update(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        previous_trace = sys.gettrace()
        sys.settrace(_StepBudget(MAX_RENDER_STEPS, cpu_limit_s))
        try:
            rendered = template.render(variables)
        except TemplateError as error:
            raise ChatTemplateError(f"messages: the model's chat template refused them: {error}") from None
        finally:
            sys.settrace(previous_trace)
        return rendered if final is None else _cut_at_continuation(rendered, final)

    async def render_async(self, messages: list[dict], timeout: float = RENDER_TIMEOUT_S, **options) -> str:
        """Renders on a worker thread, which ends the render past `timeout` of its CPU time; past
        RENDER_WALL_LIMIT_S of waiting the request fails anyway (the thread runs on to its end: Python cannot stop
        it, which is why conversations are bounded in size and count)."""
        render = asyncio.to_thread(self.render, messages, cpu_limit_s=timeout, **options)
        try:
            return await asyncio.wait_for(render, max(timeout, RENDER_WALL_LIMIT_S))
        except TimeoutError:
            limit = RENDER_WALL_LIMIT_S
            raise ChatTemplateError(f"messages: rendering the chat template took over {limit} s") from None

    def _select(self, tools: list[dict] | None) -> jinja2.Template:
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise ChatTemplateError(f"messages: the model's templates {sorted(self._templates)} have no 'default'")


def chat_options(chat) -> dict:
    """render()'s options from a gRPC ChatMessages; ChatTemplateError names a malformed field."""
    continuing = chat.continue_final_message
    generation_prompt = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not continuing
    tools = _json_field(chat.tools_json, "tools_json", list) if chat.tools_json else None
    kwargs = _json_field(chat.template_kwargs_json, "template_kwargs_json", dict) if chat.template_kwargs_json else None
    return {"add_generation_prompt": generation_prompt, "continue_final_message": continuing, "tools": tools,
            "template_kwargs": kwargs}  # fmt: skip


def _json_field(text: str, field: str, kind: type):
    try:
        value = json.loads(text)
    except ValueError:
        raise ChatTemplateError(f"{field}: not valid JSON") from None
    if not isinstance(value, kind):
        raise ChatTemplateError(f"{field}: must be a JSON {'array' if kind is list else 'object'}")
    return value


def _template_files(model_dir: Path) -> dict[str, str]:
    """The templates saved as files, the way transformers' from_pretrained collects them."""
    found = {}
    main = model_dir / CHAT_TEMPLATE_FILE
    if main.is_file():
        found["default"] = main.read_text(encoding="utf-8")
    extra = model_dir / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            found[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
    return found


def _cut_at_continuation(rendered: str, final: str) -> str:
    """The rendering up to the end of the final message (transformers' trimming), so the model continues it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatTemplateError("messages: the chat template drops part of the final message; it cannot be continued")
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to mark assistant tokens for training masks;
    serving only needs its body rendered."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attributes, which lead to Python's internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _TemplateDict:
    """`dict(...)` in a template, without handing the template the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters (<, >, &, '), which would change what the model reads.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _StepBudget:
    """A trace hook for the rendering thread: counts the lines the template's own code runs, and ends the render
    with ChatTemplateError past the budget (jinja's sandbox bounds what a template may touch, not how long it runs)."""

    def __init__(self, steps: int, cpu_limit_s: float):
        self.steps_left = steps
        self.cpu_deadline = time.thread_time() + cpu_limit_s
        self.cpu_limit_s = cpu_limit_s

    def __call__(self, frame, event, arg):  # called for every new frame: only the template's are counted
        return self._count if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    def _count(self, frame, event, arg):
        if event == "line":
            self.steps_left -= 1
            if self.steps_left < 0:
                raise ChatTemplateError(f"messages: the chat template ran over {MAX_RENDER_STEPS} steps")
            if self.steps_left % _CLOCK_EVERY_STEPS == 0 and time.thread_time() > self.cpu_deadline:
                raise ChatTemplateError(f"messages: rendering the chat template took over {self.cpu_limit_s} s")
        return self._count


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` bounded: `"a" * 10**9` would take a gigabyte in one operation."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise TemplateError(f"an exponent over {MAX_EXPONENT} in the chat template")
        if operator == "*":
            sized, count = (left, right) if isinstance(right, int) else (right, left)
            if (
                isinstance(sized, str | list | tuple)
                and isinstance(count, int)
                and len(sized) * count > MAX_PRODUCT_ITEMS
            ):
                raise TemplateError(f"a repetition of over {MAX_PRODUCT_ITEMS} items in the chat template")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str):
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


def _compile(text: str, source: str) -> jinja2.Template:
    if not isinstance(text, str):
        raise ChatTemplateLoadError(f"{source}: the chat template is not a string")
    try:
        return _environment().from_string(text)
    except TemplateError as error:
        line = f" line {error.lineno}:" if getattr(error, "lineno", None) else ""
        raise ChatTemplateLoadError(f"{source}:{line} the chat template does not compile: {error}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return config if isinstance(config, dict) else {}


def _token_text(value: object) -> str:
    if isinstance(value, dict):  # an AddedToken written out: {"content": "<s>", ...}
        return str(value.get("content", ""))
    return str(value)
