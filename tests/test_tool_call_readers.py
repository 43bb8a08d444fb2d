"""The tool-call readers on generated turns (no call, one, several, text around them, nested and unicode arguments,
a call cut by max_tokens), read whole and in random small pieces as a stream delivers them: every case gives the
expected calls and content, and the streamed content and argument pieces join to exactly the whole reading."""

from __future__ import annotations

import json
import random

import pytest

from frontend.tool_calls.calls import Piece
from frontend.tool_calls.choice import plan, read_tools, reader_for_template
from frontend.tool_calls.forced import CallListReader, NamedCallReader
from frontend.tool_calls.hermes import END, START, HermesReader
from frontend.tool_calls.leading_json import Llama3JsonReader, MistralReader

pytestmark = pytest.mark.fast

_WORDS = ["Sure", "let me check", "Paris", "naïve café", "東京", "🙂", "a < b", "<tool", "x</tool", "{", "}"]


def _arguments(rng: random.Random) -> dict:
    value = {"city": rng.choice(_WORDS), "days": rng.randint(0, 9)}
    if rng.random() < 0.5:
        value["options"] = {"units": rng.choice(["c", "f"]), "list": [rng.random() < 0.5, None, 'é\n"q"']}
    return value


def _case(rng: random.Random) -> tuple[str, str, list[tuple[str, dict]]]:
    """(model text, expected content, expected calls)."""
    text, content, calls = "", "", []
    for _ in range(rng.randint(0, 3)):
        words = " ".join(rng.sample(_WORDS, rng.randint(0, 3)))
        text, content = text + words, content + words
        name, arguments = rng.choice(["get_weather", "search", "f_1"]), _arguments(rng)
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=rng.random() < 0.5)
        text += f"{START}\n{body}\n{END}"
        calls.append((name, arguments))
    tail = rng.choice(["", " done.", "\n", "<", "<tool_c"])
    text, content = text + tail, content + tail
    if rng.random() < 0.2:  # cut by max_tokens inside a call: what was written stays text
        cut = START + '\n{"name": "search", "argu'
        text, content = text + cut, content + cut
    return text, content, calls


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        step = rng.randint(1, 5)
        out.append(text[at : at + step])
        at += step
    return out


def _joined(piece: Piece) -> list[tuple[int, str, str]]:
    joined: dict[int, list] = {}
    for delta in piece.calls:
        entry = joined.setdefault(delta.index, [delta.name, ""])
        entry[1] += delta.arguments
    return [(index, *joined[index]) for index in sorted(joined)]


def _calls(piece: Piece) -> list[tuple[str, dict]]:
    joined: dict[int, list] = {}
    for delta in piece.calls:
        entry = joined.setdefault(delta.index, [delta.name, ""])
        entry[1] += delta.arguments
    return [(name, json.loads(arguments)) for name, arguments in (joined[i] for i in sorted(joined))]


@pytest.mark.parametrize("seed", range(120))
def test_hermes_turns_read_whole_and_streamed_give_the_expected_calls(seed):
    rng = random.Random(seed)
    text, content, calls = _case(rng)
    whole = HermesReader().read_whole(text)
    assert whole.content == content and _calls(whole) == calls
    reader, streamed = HermesReader(), Piece()
    for part in _pieces(text, rng):
        piece = reader.feed(part)
        assert START not in piece.content  # never a tag in content
        streamed += piece
    streamed += reader.finish()
    assert streamed.content == whole.content
    assert _joined(streamed) == _joined(whole)  # the streamed argument pieces join to the whole turn's
    assert reader.num_calls == len(calls)
    for index in range(len(calls)):  # each call's id and name come once, with its first piece
        firsts = [d for d in streamed.calls if d.index == index and d.id]
        assert len(firsts) == 1 and firsts[0].id.startswith("call_") and firsts[0].name


def test_hermes_arguments_stream_in_pieces_as_the_model_writes_them():
    reader = HermesReader()
    text = f'Checking. {START}\n{{"name": "get_weather", "arguments": {{"city": "Par}}is", "days": [1, 2]}}}}\n{END}'
    pieces = [reader.feed(text[i : i + 4]) for i in range(0, len(text), 4)] + [reader.finish()]
    deltas = [d for p in pieces for d in p.calls]
    assert deltas[0].name == "get_weather" and deltas[0].arguments == "" and len(deltas) > 4
    assert "".join(d.arguments for d in deltas) == '{"city": "Par}is", "days": [1, 2]}'
    assert "".join(p.content for p in pieces) == "Checking. "


def test_a_call_whose_json_does_not_parse_stays_text():
    text = f'before {START}not json{END} after {START}{{"name": 5}}{END}'
    piece = HermesReader().read_whole(text)
    assert piece.content == text and piece.calls == []
    unterminated = f'{START}{{"name": "f", "arguments": {{"a": 1}}}}'  # the model stopped right after the JSON
    assert _calls(HermesReader().read_whole(unterminated)) == [("f", {"a": 1})]


def test_forced_readers_stream_a_named_call_and_read_a_list_of_calls():
    reader = NamedCallReader("get_time")
    pieces = [reader.feed(part) for part in ['{"zo', 'ne":"U', 'TC"}']] + [reader.finish()]
    deltas = [d for p in pieces for d in p.calls]
    assert deltas[0].name == "get_time" and deltas[0].id and all(not d.id for d in deltas[1:])
    assert "".join(d.arguments for d in deltas) == '{"zone":"UTC"}'
    listed = CallListReader().read_whole('[{"name":"a","arguments":{"x":1}},{"name":"b","arguments":{}}]')
    assert _calls(listed) == [("a", {"x": 1}), ("b", {})]
    assert CallListReader().read_whole('[{"name":"a","argu').content == '[{"name":"a","argu'
    cut = CallListReader().read_whole('[{"name":"a","arguments":{"x":1}},{"name":"b","argum')  # max_tokens
    assert _calls(cut) == [("a", {"x": 1})] and cut.content == ""


def test_tool_choice_plans():
    tools = read_tools(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]))
    assert plan(tools, "none", True).reader is None
    assert isinstance(plan(tools, "auto", True).new_reader(), HermesReader)
    required = json.loads(plan(tools, "required", False).constraint.spec)
    assert required["minItems"] == 1 and required["maxItems"] == 1
    assert plan(tools, "f", True).constraint.spec == '{"type": "object"}'
    for bad, words in [('[{"type": "retrieval"}]', "chat.tools_json[0]"), ("{}", "JSON array"),
                       ('[{"function": {"name": "f"}}, {"function": {"name": "f"}}]', "given twice")]:  # fmt: skip
        with pytest.raises(Exception, match=words.replace("[", r"\[")):
            read_tools(bad)


def _leading_case(rng: random.Random, reader: type) -> tuple[str, str, list[tuple[str, dict]]]:
    if rng.random() < 0.25:  # no call: text, which may hold braces later on
        text = rng.choice(["Sure: ", "The answer is 4 ", "  Hello"]) + " ".join(rng.sample(_WORDS, 3))
        return text, text, []
    calls = [(rng.choice(["get_weather", "search"]), _arguments(rng)) for _ in range(rng.randint(1, 3))]
    ascii_only = rng.random() < 0.5
    if reader is Llama3JsonReader:
        text = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=ascii_only) for n, a in calls)
    else:
        text = json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=ascii_only)
    if rng.random() < 0.15:  # cut by max_tokens inside the last call's closing braces: stays text
        return text[:-3], text[:-3], []
    return text, "", calls


@pytest.mark.parametrize("reader", [Llama3JsonReader, MistralReader], ids=["llama3_json", "mistral"])
@pytest.mark.parametrize("seed", range(110))
def test_leading_json_turns_read_whole_and_streamed_give_the_expected_calls(reader, seed):
    rng = random.Random(seed)
    text, content, calls = _leading_case(rng, reader)
    whole = reader().read_whole(text)
    assert whole.content == content and _calls(whole) == calls
    streaming, streamed = reader(), Piece()
    for part in _pieces(text, rng):
        streamed += streaming.feed(part)
    streamed += streaming.finish()
    assert streamed.content == content and _calls(streamed) == calls


def test_the_reader_follows_the_chat_templates_format():
    assert reader_for_template("{% for tool in tools %}<tool_call>{{ tool }}</tool_call>") == "hermes"
    assert reader_for_template("{{- '<|python_tag|>' }}") == "llama3_json"
    assert reader_for_template("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert reader_for_template("<|im_start|>{{ message['content'] }}") == "hermes"


def test_the_tool_call_parser_option_is_checked_per_engine_and_per_model_and_names_the_reader():
    from daemon.config import ModelSpec, ServeConfig
    from gpu_runtime.engine_config import EngineConfig

    with pytest.raises(ValueError, match=r"^tool_call_parser: must be auto\|hermes\|llama3_json\|mistral"):
        EngineConfig(tool_call_parser="xml")
    with pytest.raises(ValueError, match=r"^models\[0\]\.tool_call_parser: must be"):
        ServeConfig(models=(ModelSpec("m", tool_call_parser="xml"),))
    config = ServeConfig(models=(ModelSpec("m", tool_call_parser="mistral"), ModelSpec("n", path="tokend-tiny-random")))
    assert [config.engine_of(m).tool_call_parser for m in config.served_models()] == ["mistral", "auto"]
    tools = read_tools(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    assert isinstance(plan(tools, "auto", True, "mistral").new_reader(), MistralReader)
    assert isinstance(plan(tools, "auto", True, "llama3_json").new_reader(), Llama3JsonReader)
