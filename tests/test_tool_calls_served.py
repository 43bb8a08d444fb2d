"""Tool calls served on the default model through the official `openai` client: `required` and a named function
give calls whose arguments validate against the function's parameters (enforced), `auto` returns the call the model
makes on its own, streamed calls join to the whole body's, a tool loop (call, result, answer) completes, and bad
tool requests are 400s naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from harness.schema_corpus import validator

pytestmark = pytest.mark.daemon

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                       "required": ["zone"], "additionalProperties": False},
    },
}  # fmt: skip
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def daemon(default_model_daemon):
    return default_model_daemon


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    validator(PARAMETERS[call.function.name]).validate(json.loads(call.function.arguments))


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_are_valid_in_every_sampled_reply(client, tool_choice):
    def ask(seed: int):
        return client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                              temperature=1.0, seed=seed, max_tokens=80)  # fmt: skip

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(ask, range(16)))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and not choice.message.content
        for call in choice.message.tool_calls:
            _valid(call)
            if isinstance(tool_choice, dict):
                assert call.function.name == "get_time"


def test_one_call_only_without_parallel_tool_calls(client):
    reply = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80)  # fmt: skip
    assert len(reply.choices[0].message.tool_calls) == 1


def test_streamed_call_deltas_join_to_the_whole_calls(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                           max_tokens=80)  # fmt: skip
    stream = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=named, temperature=0,
                                            max_tokens=80, stream=True)  # fmt: skip
    pieces, finish, ids = [], None, set()
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            pieces.append(delta.function.arguments or "")
            if delta.id:
                ids.add(delta.id)
                assert delta.function.name == "get_weather"
        finish = chunk.choices[0].finish_reason or finish
    assert len(pieces) > 1  # the arguments streamed as they were generated
    assert "".join(pieces) == whole.choices[0].message.tool_calls[0].function.arguments
    assert len(ids) == 1 and finish == "tool_calls"


# A conversation in which the model called get_weather before: SmolLM2's template does not render tools, so the
# call it makes on its own under `auto` is the one it learnt in context, written in Hermes' format.
EARLIER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SHORT_ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLED_BEFORE = [{"role": "system", "content": "You are a helpful assistant."}, *SHORT_ASK,
                 {"role": "assistant", "content": EARLIER_CALL}, *SHORT_ASK]  # fmt: skip


def test_auto_returns_the_call_the_model_makes_with_finish_reason_tool_calls(client):
    ask = {"model": "", "messages": CALLED_BEFORE, "tools": TOOLS, "tool_choice": "auto", "temperature": 0,
           "max_tokens": 48}  # fmt: skip
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert not whole.message.content  # no tag characters leak into the text
    streamed, finish = "", None
    for chunk in client.chat.completions.create(**ask, stream=True):
        assert not chunk.choices[0].delta.content, "the call's text is never content"
        for delta in chunk.choices[0].delta.tool_calls or []:
            streamed += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert streamed == call.function.arguments and finish == "tool_calls"


def test_a_tool_loop_call_result_answer_completes(client):
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]  # fmt: skip
    answer = client.chat.completions.create(model="", messages=messages, tools=TOOLS, max_tokens=24, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integr"}}}],
          "tool_choice": "auto"}, "chat.tools_json[0].function.parameters", "Invalid type"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "chat.tool_choice",
         "no function named 'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "gives no tools"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}], "tools": TOOLS},
         "chat.messages[1].tool_call_id", "answers no earlier tool call"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(client, fields, param, words):
    body = {"model": "", "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**body)
    assert raised.value.status_code == 400
    assert param in raised.value.body["message"] and words in raised.value.body["message"]


def test_the_openai_agents_sdk_runs_a_tool_loop_against_tokend(daemon):
    """An agent framework nobody here wrote: the Agents SDK on the chat completions API calls our tool with valid
    arguments, sends the result back, and finishes the run with the model's answer."""
    agents = pytest.importorskip("agents")
    called = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"21 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0, timeout=120)
    model = agents.OpenAIChatCompletionsModel(model="SmolLM2-135M-Instruct", openai_client=client)
    # required for the first turn; the SDK resets tool_choice after a call, so the next turn answers in text.
    settings = agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0)
    agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather], model=model,
                         model_settings=settings)  # fmt: skip
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert called and all(isinstance(city, str) for city in called)
    assert isinstance(result.final_output, str) and result.final_output


# -- the Responses API ------------------------------------------------------------------------------------------

FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def test_responses_create_answers_text_json_schema_and_function_calls(client):
    text = client.responses.create(model="", input="Say hello.", instructions="Be brief.", max_output_tokens=16)
    assert text.status in ("completed", "incomplete") and text.output_text
    assert text.usage.input_tokens > 0 and text.usage.output_tokens > 0
    schema = PARAMETERS["get_weather"]
    weather_json = {"format": {"type": "json_schema", "name": "w", "schema": schema}}
    structured = client.responses.create(model="", input="Weather in Rome as JSON", max_output_tokens=60,
                                         text=weather_json)  # fmt: skip
    validator(schema).validate(json.loads(structured.output_text))
    called = client.responses.create(model="", input="Weather in Paris?", tools=FLAT_TOOLS, tool_choice="required",
                                     max_output_tokens=80)  # fmt: skip
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(validator(PARAMETERS[c.name]).is_valid(json.loads(c.arguments)) for c in calls)


def test_responses_stream_and_a_two_turn_tool_loop(client):
    named = {"type": "function", "name": "get_weather"}
    with client.responses.stream(model="", input="Weather in Oslo?", tools=FLAT_TOOLS, tool_choice=named,
                                 max_output_tokens=80) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert call.name == "get_weather" and validator(PARAMETERS["get_weather"]).is_valid(json.loads(call.arguments))
    follow_up = [{"role": "user", "content": "Weather in Oslo?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "3 degrees, snow"}]  # fmt: skip
    with client.responses.stream(model="", input=follow_up, tools=FLAT_TOOLS, max_output_tokens=24) as stream:
        events = list(stream)
    # Completed, or incomplete when the answer ran past max_output_tokens (as OpenAI's: the SDK's
    # get_final_response() then raises, so the last event's response is read instead).
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    text = "".join(part.text for item in events[-1].response.output if item.type == "message" for part in item.content)
    assert deltas and "".join(deltas) == text


@pytest.mark.parametrize("field", ["previous_response_id", "store"])
def test_responses_refuse_server_side_state_naming_the_field(client, field):
    value = "resp_123" if field == "previous_response_id" else True
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(model="", input="Hi", **{field: value})
    assert raised.value.body["param"] == field
