"""The tool-call readers on turns rendered by each family's real chat template and tokenized by its real tokenizer:
Qwen2.5's template (Hermes' <tool_call>) with Qwen2's BPE, Llama 3.1's (bare JSON calls) with Llama 3's BPE, and
Mistral Nemo's (`[TOOL_CALLS][...]`) with Nemo's tekken tokenizer from `mistral-common`.

Each case is what the model emits for an assistant turn (no call, one call, several where the template allows them,
text around them where it keeps it, nested and unicode arguments, a turn cut by max_tokens): the template renders
it, the tokenizer encodes it, and the tokens come back through the frontend's incremental detokenizer one at a time,
as a stream delivers them. Read whole and read token by token, every case gives its expected calls and content,
and the streamed pieces join to exactly the whole reading.

The templates and Qwen/Llama vocabularies are llama.cpp's copies, the vocabularies rebuilt as tokenizer.json by
tokend's GGUF tokenizer reader (scripts/fetch_chat_formats.py, run by scripts/bootstrap.sh for the dev extras).
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

from common.chat_template import ChatTemplate
from frontend.text_stream import IncrementalDetokenizer
from frontend.tool_calls.calls import CallReader, Piece
from frontend.tool_calls.choice import READERS, reader_for_template
from scripts.fetch_chat_formats import formats_dir

pytestmark = pytest.mark.engine

CASES_PER_FAMILY = 120
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": {"type": "object"}}}
    for name in ("get_weather", "search", "book_flight")
]
_WORDS = ["Sure", "let me check", "Paris", "naïve café", "東京", "🙂", "a < b", "<tool", "{", "}", "[", "\n"]


@dataclass(frozen=True)
class Family:
    reader: str  # READERS' name, and what reader_for_template must pick for this template
    template: str  # file under formats_dir()
    special_tokens: dict[str, str]
    end_of_turn: str  # the stop token that ends the turn (not part of what is read)
    max_calls: int  # what the template can render (Llama 3.1's raises past one)
    keeps_content: bool  # whether the template renders an assistant's text beside its calls
    tokenizer: Callable[[], Tokenizer]


def _gguf_tokenizer(name: str, added: tuple[str, ...] = ()) -> Callable[[], Tokenizer]:
    def load() -> Tokenizer:
        tokenizer = Tokenizer.from_file(str(_fixture(name)))  # tokend's rebuild of a GGUF vocabulary
        # Qwen2.5's tokenizer.json adds <tool_call> and </tool_call> as whole, non-special tokens (decoded as text).
        tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in added])
        return tokenizer

    return load


def _tekken() -> Tokenizer:
    import mistral_common
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    path = Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"  # Mistral Nemo's tokenizer
    return convert_tekken_tokenizer(str(path), chat_template="unused").backend_tokenizer


FAMILIES = {
    "qwen2.5": Family(
        "hermes", "Qwen-Qwen2.5-7B-Instruct.jinja", {}, "<|im_end|>", 3, True,
        _gguf_tokenizer("ggml-vocab-qwen2.tokenizer.json", added=("<tool_call>", "</tool_call>")),
    ),
    # The same template over the bare BPE: each tag arrives as several tokens, split anywhere.
    "qwen2.5-tags-as-bpe": Family(
        "hermes", "Qwen-Qwen2.5-7B-Instruct.jinja", {}, "<|im_end|>", 3, True,
        _gguf_tokenizer("ggml-vocab-qwen2.tokenizer.json"),
    ),
    "llama3.1": Family(
        "llama3_json", "meta-llama-Llama-3.1-8B-Instruct.jinja", {"bos_token": "<|begin_of_text|>"}, "<|eot_id|>",
        1, False, _gguf_tokenizer("ggml-vocab-llama-bpe.tokenizer.json"),
    ),
    "mistral-nemo": Family(
        "mistral", "mistralai-Mistral-Nemo-Instruct-2407.jinja", {"bos_token": "<s>", "eos_token": "</s>"}, "</s>",
        3, False, _tekken,
    ),
}  # fmt: skip


def _fixture(name: str) -> Path:
    path = formats_dir() / name
    if not path.is_file():
        pytest.skip(f"{path} is missing: scripts/fetch_chat_formats.py fetches it (scripts/bootstrap.sh dev runs it)")
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[Family, ChatTemplate, Tokenizer]:
    spec = FAMILIES[request.param]
    template = ChatTemplate(_fixture(spec.template).read_text(encoding="utf-8"), spec.special_tokens, spec.template)
    return spec, template, spec.tokenizer()


def _arguments(rng: random.Random) -> dict:
    value: dict = {"city": rng.choice(_WORDS), "days": rng.randint(0, 9)}
    if rng.random() < 0.5:
        value["options"] = {"units": rng.choice(["c", "f"]), "nested": [{"deep": [True, None, 'é\n"q"\\']}, 1.5]}
    return value


def _call_id(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters + string.digits, k=9))  # Nemo's template wants 9 alphanumerics


@dataclass
class Case:
    token_ids: list[int]
    content: str | None  # expected content (None: a Hermes turn cut by max_tokens, decided by what streamed)
    calls: list[tuple[str, dict]]  # expected (name, arguments)
    kind: str  # "no call", "one call", "several calls" or "cut by max_tokens"
    cut_call: tuple[str, dict] | None = None  # the call max_tokens cut, if it cut one


def _case(rng: random.Random, spec: Family, template: ChatTemplate, tokenizer: Tokenizer) -> Case:
    """One assistant turn: rendered by the template after its generation prompt, up to the stop token."""
    calls = [(rng.choice(TOOLS)["function"]["name"], _arguments(rng)) for _ in range(rng.randint(0, spec.max_calls))]
    text = " ".join(rng.sample(_WORDS, rng.randint(1, 3))) if not calls or spec.keeps_content else ""
    if not calls and spec.reader != "hermes":
        text = text.lstrip("[{ \n") or "ok"  # a content turn of a leading-JSON format does not open like a call
    conversation = [{"role": "user", "content": "What should I do today?"}]
    prompt = template.render(conversation, tools=TOOLS)
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {"id": _call_id(rng), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]
    rendered = template.render([*conversation, message], tools=TOOLS, add_generation_prompt=False)
    assert rendered.startswith(prompt), "the template renders the turn after its generation prompt"
    turn = rendered[len(prompt) :]
    turn = turn[: turn.rindex(spec.end_of_turn)]
    token_ids = tokenizer.encode(turn, add_special_tokens=False).ids
    if calls and rng.random() < 0.2:
        return _cut_by_max_tokens(token_ids, rng, spec, tokenizer, calls)
    content = _outside_calls(turn) if spec.reader == "hermes" else "" if calls else turn
    kind = {0: "no call", 1: "one call"}.get(len(calls), "several calls")
    return Case(token_ids, content, calls, kind)


def _cut_by_max_tokens(token_ids, rng, spec: Family, tokenizer: Tokenizer, calls) -> Case:
    """The turn cut short. A leading-JSON turn is then content, as written. In Hermes' format the calls closed
    before the cut are calls; the one being written is a call with its arguments so far when they had begun to
    stream (as OpenAI streams a call cut by max_tokens), else it stays content."""
    token_ids = token_ids[: rng.randint(1, len(token_ids) - 2)]
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if spec.reader != "hermes":
        return Case(token_ids, text, [], "cut by max_tokens")
    closed = text.count("</tool_call>")
    cut_call = calls[closed] if closed < len(calls) else None
    return Case(token_ids, None, calls[:closed], "cut by max_tokens", cut_call)


def _outside_calls(turn: str, open_call_is_content: bool = True) -> str:
    """Hermes' content: the turn's text with each <tool_call>...</tool_call> taken out (and an unclosed one at the
    end too, unless it stays content)."""
    out, at = "", 0
    while (start := turn.find("<tool_call>", at)) >= 0:
        out += turn[at:start]
        end = turn.find("</tool_call>", start)
        if end < 0:
            return out + (turn[start:] if open_call_is_content else "")
        at = end + len("</tool_call>")
    return out + turn[at:]


def _read_streamed(reader: CallReader, tokenizer: Tokenizer, token_ids: list[int]) -> Piece:
    detokenizer = IncrementalDetokenizer(tokenizer)
    piece = Piece()
    for token_id in token_ids:
        piece += reader.feed(detokenizer.push([token_id]))
    piece += reader.feed(detokenizer.finish())
    piece += reader.finish()
    return piece


def _calls_of(piece: Piece) -> list[tuple[str, str]]:
    joined: dict[int, list[str]] = {}
    for delta in piece.calls:
        entry = joined.setdefault(delta.index, ["", ""])
        entry[0] += delta.name
        entry[1] += delta.arguments
    assert sorted(joined) == list(range(len(joined))), "call indexes count from 0 without gaps"
    return [(name, arguments) for name, arguments in (joined[i] for i in sorted(joined))]


def test_auto_picks_the_reader_for_each_real_template(family):
    spec, template, _ = family
    assert reader_for_template(template.text) == spec.reader


def test_turns_rendered_and_tokenized_read_to_their_calls_whole_and_token_by_token(family):
    spec, template, tokenizer = family
    rng = random.Random(spec.template)
    kinds = dict.fromkeys(["no call", "one call", "several calls", "cut by max_tokens"], 0)
    for number in range(CASES_PER_FAMILY):
        case = _case(rng, spec, template, tokenizer)
        whole_text = tokenizer.decode(case.token_ids, skip_special_tokens=True)
        whole = READERS[spec.reader]().read_whole(whole_text)
        streamed = _read_streamed(READERS[spec.reader](), tokenizer, case.token_ids)
        where = f"case {number}: {whole_text!r}"
        got = _calls_of(whole)
        assert _calls_of(streamed) == got, f"{where}: the streamed names and argument pieces join to the whole"
        assert streamed.content == whole.content, where
        content = case.content
        if case.kind == "cut by max_tokens" and spec.reader == "hermes":
            began = len(got) > len(case.calls)  # the cut call's arguments had begun to stream
            if began:
                ((name, arguments),) = got[len(case.calls) :]
                assert name == case.cut_call[0], where
                assert json.dumps(case.cut_call[1], ensure_ascii=False).startswith(arguments), where
                got = got[: len(case.calls)]
            content = _outside_calls(whole_text, open_call_is_content=not began)
        assert [(name, json.loads(arguments)) for name, arguments in got] == case.calls, where
        assert whole.content == content, where
        kinds[case.kind] += 1
    expected_kinds = [kind for kind in kinds if kind != "several calls" or spec.max_calls > 1]
    assert all(kinds[kind] >= 8 for kind in expected_kinds), kinds
