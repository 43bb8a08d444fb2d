"""Checks a GenerateRequest against the model it goes to; every failure names the field it is about."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.errors import invalid
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.tokenizer import Tokenizer
from tokend.v1 import tokend_pb2 as pb

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_MESSAGES = 256
# proto3 `optional` fields of pb.SamplingParams, whose absence means SamplingParams' default
_OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "logprobs")

_PRIORITIES = {
    pb.PRIORITY_UNSPECIFIED: None,  # the tenant's default class
    pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_BATCH: Priority.BATCH,
}


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sent to the scheduler as it is
    stop: list[str]
    priority: Priority | None  # None: the request did not ask for a class


def prepare(
    request: pb.GenerateRequest, model: SchedulerReady, tokenizer: Tokenizer, chat_prompt: str | None = None
) -> PreparedRequest:
    """Validates and tokenizes; raises RequestError (INVALID_ARGUMENT) naming the first bad field.

    A chat request arrives with its conversation already rendered into `chat_prompt`."""
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not request.request_id.isprintable():
        raise invalid(f"request_id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
    if request.priority not in _PRIORITIES:
        raise invalid(f"priority: unknown value {request.priority}")
    token_ids = _prompt_token_ids(request, model, tokenizer, chat_prompt)
    room = model.max_model_len - len(token_ids)
    if room < 1:
        field = {"token_ids": "token_ids", "chat": "chat.messages"}.get(request.WhichOneof("input"), "prompt")
        raise invalid(
            f"{field}: {len(token_ids)} tokens leave no room to generate in the context of {model.max_model_len}"
        )
    fill_to = None
    if request.sampling.fill_context and not request.sampling.HasField("max_tokens"):
        # As much as the context allows, and never more than the whole KV cache can hold.
        fill_to = max(1, min(room, model.num_pages * model.page_size - len(token_ids)))
    params, stop = _sampling_params(request.sampling, fill_to)
    if params.max_tokens > room:
        raise invalid(
            f"sampling.max_tokens: the prompt's {len(token_ids)} tokens plus max_tokens {params.max_tokens} exceed "
            f"the context of {model.max_model_len} tokens"
        )
    longest = len(token_ids) + params.max_tokens
    pages_needed = -(-longest // model.page_size)
    if pages_needed > model.num_pages:
        raise invalid(
            f"sampling.max_tokens: prompt plus max_tokens ({longest} tokens) need {pages_needed} KV pages, "
            f"but the whole cache holds {model.num_pages}"
        )
    return PreparedRequest(token_ids, params, stop, _PRIORITIES[request.priority])


def _sampling_params(wire: pb.SamplingParams, fill_to: int | None) -> tuple[SamplingParams, list[str]]:
    stop = list(wire.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in stop):
        raise invalid(f"sampling.stop: each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
    # Only the fields the client set: SamplingParams alone declares the defaults.
    given = {name: getattr(wire, name) for name in _OPTIONAL_SAMPLING_FIELDS if wire.HasField(name)}
    if fill_to is not None:
        given["max_tokens"] = fill_to
    try:
        params = SamplingParams(
            top_k=wire.top_k,
            min_p=wire.min_p,
            stop_token_ids=tuple(wire.stop_token_ids),
            ignore_eos=wire.ignore_eos,
            **given,
        )
    except ValueError as error:  # SamplingParams names the field; the wire name adds its message
        raise invalid(f"sampling.{error}") from None
    return params, stop


def chat_messages(request: pb.GenerateRequest) -> list[dict[str, str]]:
    """The conversation of a chat request as the template expects it; INVALID_ARGUMENT names a bad message."""
    messages = request.chat.messages
    if not 1 <= len(messages) <= MAX_CHAT_MESSAGES:
        raise invalid(f"chat.messages: must hold 1 to {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    for index, message in enumerate(messages):
        if not message.role or len(message.role) > 64:
            raise invalid(f"chat.messages[{index}].role: must be a non-empty name of at most 64 characters")
    return [{"role": message.role, "content": message.content} for message in messages]


def _prompt_token_ids(
    request: pb.GenerateRequest, model: SchedulerReady, tokenizer: Tokenizer, chat_prompt: str | None
) -> list[int]:
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("prompt: give prompt (text), token_ids or chat")
    if which == "chat":
        token_ids = tokenizer.encode(chat_prompt or "", add_special_tokens=False)  # the template wrote the BOS
        if not token_ids:
            raise invalid("chat.messages: render to no tokens")
        return token_ids
    if which == "prompt":
        if not request.prompt:
            raise invalid("prompt: must not be empty")
        token_ids = tokenizer.encode(request.prompt)
        if not token_ids:
            raise invalid("prompt: tokenizes to no tokens")
        return token_ids
    token_ids = list(request.token_ids.ids)
    if not token_ids:
        raise invalid("token_ids: must not be empty")
    for index, token_id in enumerate(token_ids):
        if token_id >= model.vocab_size:
            raise invalid(
                f"token_ids: id {token_id} at index {index} is outside the vocabulary [0, {model.vocab_size})"
            )
    return token_ids
