"""The OpenAI request bodies this gateway accepts, decoded with msgspec, and their translation to gRPC.

Unknown fields are ignored as OpenAI's own API does; a field of the wrong type is a 400 naming it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec

from frontend.gateway.errors import bad_request
from frontend.gateway.json_wire import MAX_JSON_DEPTH, nesting_exceeds
from frontend.gateway.request_ids import per_choice
from frontend.gateway.structured_fields import structured_output
from tokend.v1 import tokend_pb2 as pb

_UINT32_END = 2**32
# The integer fields that reach a protobuf field as they are, and the end of that field's range: uint32 or uint64.
# (max_tokens and max_completion_tokens reach one clamped; n and best_of never reach one.)
_INTEGER_ENDS = {"top_k": _UINT32_END, "logprobs": _UINT32_END, "top_logprobs": _UINT32_END,
                 "prompt_logprobs": _UINT32_END, "seed": 2**64}  # fmt: skip
_CLAMPED = ("max_tokens", "max_completion_tokens")  # clamped to the field's range; below 1 is refused (but see echo)
# The unsupported fields of SamplingFields, and the values that ask for nothing (and so are accepted).
_UNSUPPORTED = {
    "min_tokens": (None, 0),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
}
# A batch of prompts fans out into prompts x n gRPC calls, each holding a place in the frontend's admission queue:
# the bound keeps one request from filling that queue (256 places by default) on its own.
MAX_BATCH_CHOICES = 128


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """What completions and chat completions share, vLLM's extensions (top_k, min_p, ...) included."""

    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI's: token ids (as strings, JSON keys being strings) to a bias added to their logits.
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's sampling extensions tokend does not implement, decoded only to be refused (see _UNSUPPORTED): a client
    # that turns one on must not get output it did not ask for.
    min_tokens: int | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's: the prompt tokens' own logprobs (and the top n at each position), in the answer's `prompt_logprobs`.
    prompt_logprobs: int | None = None
    # Structured outputs, OpenAI's way and vLLM's (see structured_fields): one of them per request.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # tokend's admission class (vLLM takes an integer here; ours are named): unset is the tenant's own class.
    priority: Literal["interactive", "batch"] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of token ids (one prompt), or a batch: a list of strings or of token id lists.
    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, as OpenAI returned them
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extensions for the chat template (see docs/chat-templates.md).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


def decode(body: bytes, request_type: type):
    """Decodes a body; a 400 says what was wrong and which field (param) it was."""
    if nesting_exceeds(body, MAX_JSON_DEPTH):
        raise bad_request(f"the body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep")
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as error:
        match = re.search(r"at `\$\.?([^`]*)`", str(error))
        raise bad_request(f"invalid request: {error}", match.group(1) if match else None) from None
    except msgspec.DecodeError as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    except RecursionError:  # the nesting check above should have caught it; the decoder's own guard, kept polite
        raise bad_request("the body nests arrays and objects too deeply") from None


def completion_to_grpc(request: CompletionRequest, max_n: int, request_id: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice: n for each prompt, in the order of their `index` (prompt index * n + choice),
    each with its request id (see request_ids.per_choice)."""
    _check_common(request, max_n)
    if request.suffix is not None:
        raise bad_request("suffix: not supported by this server; leave it unset", "suffix")
    if request.best_of not in (None, request.n):
        raise bad_request("best_of other than n is not supported", "best_of")
    prompts = completion_prompts(request.prompt)
    if len(prompts) * request.n > MAX_BATCH_CHOICES:
        raise bad_request(
            f"prompt: at most {MAX_BATCH_CHOICES} choices (prompts x n) per request; "
            f"got {len(prompts)} prompts x n={request.n}",
            "prompt",
        )
    sampling = _sampling(request, request.max_tokens, request.logprobs)  # unset: the API default (16, as OpenAI)
    # The echoed prompt's tokens come with their logprobs; with max_tokens 0 the prompt is all there is (scored).
    if request.echo and (request.logprobs is not None or request.max_tokens == 0):
        sampling.prompt_logprobs = max(request.logprobs or 0, sampling.prompt_logprobs)
    choice_ids = per_choice(request_id, len(prompts) * request.n)
    requests = []
    for index, prompt in enumerate(prompts):
        base = pb.GenerateRequest(model=request.model, sampling=sampling, priority=_priority(request))
        if isinstance(prompt, str):
            base.prompt = prompt
        else:
            base.token_ids.ids.extend(prompt)
        requests += _choices(base, choice_ids[index * request.n : (index + 1) * request.n])
    return requests


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompts a completions request holds, as OpenAI reads its `prompt`: a string or a list of token ids is one
    prompt; a list of strings, or of token id lists, is a batch."""
    if isinstance(prompt, str) or all(isinstance(item, int) for item in prompt):
        prompts, batch = [prompt], False
    elif all(isinstance(item, str) for item in prompt) or all(isinstance(item, list) for item in prompt):
        prompts, batch = list(prompt), True
    else:
        raise bad_request(
            "prompt: a string, a list of token ids, or a list of either (strings and token ids not mixed)", "prompt"
        )
    for index, item in enumerate(prompts):
        if isinstance(item, list) and item and not (min(item) >= 0 and max(item) < _UINT32_END):
            field = f"prompt[{index}]" if batch else "prompt"
            raise bad_request(f"{field}: token ids must be between 0 and {_UINT32_END - 1}", field)
    return prompts


def chat_to_grpc(request: ChatCompletionRequest, max_n: int, request_id: str) -> list[pb.GenerateRequest]:
    _check_common(request, max_n)
    tool_choice = _tool_choice(request)
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = None
    if request.logprobs:
        logprobs = request.top_logprobs or 0
    elif request.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = _sampling(request, max_tokens, logprobs)
    if max_tokens is None:
        sampling.fill_context = True  # OpenAI's chat default: up to the end of the context
    messages = [chat_message(m, index) for index, m in enumerate(request.messages)]
    chat = pb.ChatMessages(
        messages=messages,
        add_generation_prompt=request.add_generation_prompt,  # None leaves it unset: the template's default
        continue_final_message=request.continue_final_message,
        tools_json=json.dumps(request.tools) if request.tools and tool_choice != "none" else "",
        template_kwargs_json=json.dumps(request.chat_template_kwargs) if request.chat_template_kwargs else "",
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,  # None leaves it unset: parallel calls allowed
    )
    base = pb.GenerateRequest(model=request.model, sampling=sampling, chat=chat, priority=_priority(request))
    return _choices(base, per_choice(request_id, request.n))


def _check_common(request: SamplingFields, max_n: int) -> None:
    if not 1 <= request.n <= max_n:
        raise bad_request(f"n: must be between 1 and {max_n}, got {request.n}", "n")
    for name, off in _UNSUPPORTED.items():
        if getattr(request, name) not in off:
            raise bad_request(f"{name}: not supported by this server; leave it unset", name)
    # Checked here because the protobuf fields they go into raise a bare ValueError ("Value out of range") that
    # names no field. max_tokens and max_completion_tokens are clamped instead, so they only need to be positive.
    for name, end in _INTEGER_ENDS.items():
        value = getattr(request, name, None)
        if value is not None and not 0 <= value < end:
            raise bad_request(f"{name}: must be between 0 and {end - 1}, got {value}", name)
    for name in _CLAMPED:
        value = getattr(request, name, None)
        if value is not None and value < _least_tokens(request):
            raise bad_request(f"{name}: must be at least 1 (0 with echo), got {value}", name)
    if any(not 0 <= t < _UINT32_END for t in request.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids: token ids must be between 0 and {_UINT32_END - 1}", "stop_token_ids")
    # Ranges, the vocabulary and the count are the frontend's checks (they hold for gRPC clients too); here only
    # what the protobuf map could not carry: keys that are not token ids.
    for key in request.logit_bias or {}:
        if not (key.isascii() and key.isdigit() and int(key) < _UINT32_END):
            raise bad_request(f"logit_bias: keys must be token ids (0 to {_UINT32_END - 1}), got {key!r}", "logit_bias")


def _sampling(request: SamplingFields, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        ignore_eos=request.ignore_eos,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=request.stop_token_ids or [],
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias={int(key): bias for key, bias in (request.logit_bias or {}).items()},
    )
    if (constraint := structured_output(request)) is not None:
        sampling.structured_output.CopyFrom(constraint)
    # Unset stays unset, so that the model's generation_config.json defaults apply (see protos' SamplingParams).
    for name in ("top_k", "min_p", "repetition_penalty"):
        if (value := getattr(request, name)) is not None:
            setattr(sampling, name, value)
    if max_tokens is not None:
        if max_tokens < _least_tokens(request):
            raise bad_request(f"max_tokens: must be at least 1 (0 with echo), got {max_tokens}", "max_tokens")
        sampling.max_tokens = min(max_tokens, 2**32 - 1)
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.seed is not None:
        sampling.seed = request.seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    if request.prompt_logprobs is not None:
        sampling.prompt_logprobs = request.prompt_logprobs
    return sampling


def _least_tokens(request: SamplingFields) -> int:
    """The fewest tokens a request may ask for: 1, or 0 for completions' echo (the prompt alone, as vLLM's)."""
    return 0 if getattr(request, "echo", False) else 1


def _priority(request: SamplingFields) -> pb.Priority:
    return {"interactive": pb.PRIORITY_INTERACTIVE, "batch": pb.PRIORITY_BATCH}.get(
        request.priority, pb.PRIORITY_UNSPECIFIED
    )


def _choices(base: pb.GenerateRequest, choice_ids: list[str]) -> list[pb.GenerateRequest]:
    """One prompt's n requests; with a seed, its choice i samples with seed + i so that the choices differ but
    repeat (and a prompt samples alike alone or in a batch)."""
    requests = []
    for index, choice_id in enumerate(choice_ids):
        request = pb.GenerateRequest()
        request.CopyFrom(base)
        request.request_id = choice_id
        if index and base.sampling.HasField("seed"):
            request.sampling.seed = (base.sampling.seed + index) % 2**64
        requests.append(request)
    return requests


def _tool_choice(request: ChatCompletionRequest) -> str:
    """OpenAI's tool_choice as the frontend's string: auto, none, required, or a function's name."""
    choice = request.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request('tool_choice: must be auto, none, required or {"type": "function", "function": '
                              '{"name": ...}}', "tool_choice")  # fmt: skip
        choice = function["name"]
    elif choice not in (None, "auto", "none", "required"):
        raise bad_request(f"tool_choice: must be auto, none, required or a function, got {choice!r}", "tool_choice")
    if choice not in (None, "auto", "none") and not request.tools:
        raise bad_request("tool_choice: asks for a tool call, but the request gives no tools", "tool_choice")
    return choice or ""


def chat_message(message: ChatMessage, index: int) -> pb.ChatMessage:
    return pb.ChatMessage(
        role=message.role,
        content=_text(message, index),
        name=message.name or "",
        tool_calls_json=json.dumps(message.tool_calls) if message.tool_calls else "",
        tool_call_id=message.tool_call_id or "",
    )


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text":
            raise bad_request(f"messages[{index}].content: only text parts are supported", f"messages[{index}].content")
        parts.append(part.text or "")
    return "".join(parts)
