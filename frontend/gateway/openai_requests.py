"""The OpenAI request bodies this gateway accepts, decoded with msgspec, and their translation to gRPC.

Unknown fields are ignored as OpenAI's own API does; a field of the wrong type is a 400 naming it.
"""

from __future__ import annotations

import re

import msgspec

from frontend.gateway.errors import bad_request
from frontend.gateway.json_wire import MAX_JSON_DEPTH, nesting_exceeds
from tokend.v1 import tokend_pb2 as pb

_UINT32_END = 2**32
# The integer fields that reach a protobuf field as they are, and the end of that field's range: uint32 or uint64.
# (max_tokens and max_completion_tokens reach one clamped; n and best_of never reach one.)
_INTEGER_ENDS = {"top_k": _UINT32_END, "logprobs": _UINT32_END, "top_logprobs": _UINT32_END, "seed": 2**64}
_CLAMPED = ("max_tokens", "max_completion_tokens")  # clamped to the field's range; below 1 is refused


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
    user: str | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[int | str]
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


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None


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


def completion_to_grpc(request: CompletionRequest, max_n: int) -> list[pb.GenerateRequest]:
    """One GenerateRequest per choice (n of them)."""
    _check_common(request, max_n)
    if request.echo or request.suffix is not None:
        raise bad_request("echo and suffix are not supported", "echo" if request.echo else "suffix")
    if request.best_of not in (None, request.n):
        raise bad_request("best_of other than n is not supported", "best_of")
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list) and not all(isinstance(t, int) for t in prompt):
        raise bad_request("prompt: a string, or a list of token ids; send one request per prompt", "prompt")
    if isinstance(prompt, list) and prompt and not (min(prompt) >= 0 and max(prompt) < _UINT32_END):
        raise bad_request(f"prompt: token ids must be between 0 and {_UINT32_END - 1}", "prompt")
    sampling = _sampling(request, request.max_tokens, request.logprobs)  # unset: the API default (16, as OpenAI)
    base = pb.GenerateRequest(model=request.model, sampling=sampling)
    if isinstance(prompt, str):
        base.prompt = prompt
    else:
        base.token_ids.ids.extend(prompt)
    return _per_choice(base, request.n)


def chat_to_grpc(request: ChatCompletionRequest, max_n: int) -> list[pb.GenerateRequest]:
    _check_common(request, max_n)
    if request.tools:
        raise bad_request("tools are not supported", "tools")
    if request.response_format not in (None, {"type": "text"}):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    logprobs = None
    if request.logprobs:
        logprobs = request.top_logprobs or 0
    elif request.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    sampling = _sampling(request, max_tokens, logprobs)
    if max_tokens is None:
        sampling.fill_context = True  # OpenAI's chat default: up to the end of the context
    messages = [pb.ChatMessage(role=m.role, content=_text(m, index)) for index, m in enumerate(request.messages)]
    base = pb.GenerateRequest(model=request.model, sampling=sampling, chat=pb.ChatMessages(messages=messages))
    return _per_choice(base, request.n)


def _check_common(request: SamplingFields, max_n: int) -> None:
    if not 1 <= request.n <= max_n:
        raise bad_request(f"n: must be between 1 and {max_n}, got {request.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise bad_request(f"{name}: penalties are not supported; leave it 0", name)
    # Checked here because the protobuf fields they go into raise a bare ValueError ("Value out of range") that
    # names no field. max_tokens and max_completion_tokens are clamped instead, so they only need to be positive.
    for name, end in _INTEGER_ENDS.items():
        value = getattr(request, name, None)
        if value is not None and not 0 <= value < end:
            raise bad_request(f"{name}: must be between 0 and {end - 1}, got {value}", name)
    for name in _CLAMPED:
        value = getattr(request, name, None)
        if value is not None and value < 1:
            raise bad_request(f"{name}: must be at least 1, got {value}", name)
    if any(not 0 <= t < _UINT32_END for t in request.stop_token_ids or ()):
        raise bad_request(f"stop_token_ids: token ids must be between 0 and {_UINT32_END - 1}", "stop_token_ids")


def _sampling(request: SamplingFields, max_tokens: int | None, logprobs: int | None) -> pb.SamplingParams:
    sampling = pb.SamplingParams(
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        ignore_eos=request.ignore_eos,
        stop=[request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        stop_token_ids=request.stop_token_ids or [],
    )
    if max_tokens is not None:
        if max_tokens < 1:
            raise bad_request(f"max_tokens: must be at least 1, got {max_tokens}", "max_tokens")
        sampling.max_tokens = min(max_tokens, 2**32 - 1)
    if request.temperature is not None:
        sampling.temperature = request.temperature
    if request.top_p is not None:
        sampling.top_p = request.top_p
    if request.seed is not None:
        sampling.seed = request.seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    return sampling


def _per_choice(base: pb.GenerateRequest, n: int) -> list[pb.GenerateRequest]:
    """n requests; with a seed, choice i samples with seed + i so that the choices differ but repeat."""
    requests = []
    for index in range(n):
        request = pb.GenerateRequest()
        request.CopyFrom(base)
        if index and base.sampling.HasField("seed"):
            request.sampling.seed = (base.sampling.seed + index) % 2**64
        requests.append(request)
    return requests


def _text(message: ChatMessage, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.type != "text":
            raise bad_request(f"messages[{index}].content: only text parts are supported", f"messages[{index}].content")
        parts.append(part.text or "")
    return "".join(parts)
