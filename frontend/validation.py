"""Checks a GenerateRequest against the model it goes to; every failure names the field it is about."""

from __future__ import annotations

from dataclasses import dataclass

from frontend.errors import RequestError, invalid
from frontend.structured_outputs import structured_output_of
from frontend.tool_calls.messages import template_message
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.ipc.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from gpu_runtime.kv_cache.page_budget import largest_chunk, most_tokens_held, pages_held_at_most
from tokend.v1 import tokend_pb2 as pb

MAX_STOP_STRINGS = 8
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 128
MAX_CHAT_MESSAGES = 256
# No tokenizer averages more characters per token than this over a whole prompt, so a longer text cannot fit the
# context: it is refused before tokenizing it, which would cost seconds and hundreds of MB for nothing.
MAX_CHARS_PER_TOKEN = 32
# proto3 `optional` fields of pb.SamplingParams, whose absence means the model's default (see SamplingDefaults)
# or else SamplingParams' own
_OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "repetition_penalty",
)

PRIORITIES = {
    pb.PRIORITY_UNSPECIFIED: None,  # the tenant's default class
    pb.PRIORITY_INTERACTIVE: Priority.INTERACTIVE,
    pb.PRIORITY_BATCH: Priority.BATCH,
}


@dataclass(frozen=True, slots=True)
class PromptText:
    field: str  # the request field it came from, named in errors
    text: str
    add_special_tokens: bool


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    prompt_token_ids: list[int]
    sampling: SamplingParams  # sent to the scheduler as it is
    stop: list[str]
    priority: Priority | None  # None: the request did not ask for a class


def check_envelope(request: pb.GenerateRequest) -> None:
    """The fields checked before any work is spent on the request."""
    request_id = request.request_id
    # ASCII: it goes back to the client in the x-request-id header, and gRPC metadata is ASCII.
    if len(request_id) > MAX_REQUEST_ID_CHARS or not (request_id.isascii() and request_id.isprintable()):
        raise invalid(f"request_id: must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters")
    if request.priority not in PRIORITIES:
        raise invalid(f"priority: unknown value {request.priority}")


def prepare(request: pb.GenerateRequest, model: SchedulerReady, token_ids: list[int]) -> PreparedRequest:
    """Validates the request around its prompt's token ids; raises RequestError (INVALID_ARGUMENT) naming the
    first bad field."""
    room = model.max_model_len - len(token_ids)
    if room < 1:
        field = {"token_ids": "token_ids", "chat": "chat.messages"}.get(request.WhichOneof("input"), "prompt")
        raise no_room(field, len(token_ids), model)
    fill_to = None
    if request.sampling.fill_context and not request.sampling.HasField("max_tokens"):
        # As much as the context allows, and never more than the whole KV cache can hold (in every KV group).
        chunk = largest_chunk(len(token_ids), model.max_prefill_chunk)
        most = most_tokens_held(model.num_pages, model.page_size, model.kv_windows, chunk)
        fill_to = max(1, min(room, most - len(token_ids)))
    params, stop = _sampling_params(request.sampling, fill_to, model)
    if params.max_tokens > room:
        raise invalid(
            f"sampling.max_tokens: the prompt's {len(token_ids)} tokens plus max_tokens {params.max_tokens} exceed "
            f"the context of {model.max_model_len} tokens"
        )
    longest = len(token_ids) + params.max_tokens
    chunk = largest_chunk(len(token_ids), model.max_prefill_chunk)
    pages_needed = pages_held_at_most(longest, model.page_size, model.kv_windows, chunk)  # as the engine counts them
    if pages_needed > model.num_pages:
        raise invalid(
            f"sampling.max_tokens: prompt plus max_tokens ({longest} tokens) need {pages_needed} KV pages at once, "
            f"but the whole cache holds {model.num_pages}"
        )
    return PreparedRequest(token_ids, params, stop, PRIORITIES[request.priority])


def _sampling_params(
    wire: pb.SamplingParams, fill_to: int | None, model: SchedulerReady
) -> tuple[SamplingParams, list[str]]:
    stop = list(wire.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"sampling.stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if any(not 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in stop):
        raise invalid(f"sampling.stop: each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters")
    # Only the fields the client set, over the model's own defaults: SamplingParams declares the rest.
    given = model.sampling_defaults.as_dict()
    given.update({name: getattr(wire, name) for name in _OPTIONAL_SAMPLING_FIELDS if wire.HasField(name)})
    if fill_to is not None:
        given["max_tokens"] = fill_to
    if len(wire.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:  # before copying a map that may be huge
        raise invalid(
            f"sampling.logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {len(wire.logit_bias)}"
        )
    try:
        params = SamplingParams(
            stop_token_ids=tuple(wire.stop_token_ids),
            ignore_eos=wire.ignore_eos,
            presence_penalty=wire.presence_penalty,
            frequency_penalty=wire.frequency_penalty,
            logit_bias=dict(wire.logit_bias),
            structured_output=structured_output_of(wire),
            **given,
        )
    except ValueError as error:  # SamplingParams names the field; the wire name adds its message
        raise invalid(f"sampling.{error}") from None
    outside = [token_id for token_id, _ in params.logit_bias if token_id >= model.vocab_size]
    if outside:
        raise invalid(f"sampling.logit_bias: token id {outside[0]} is outside the vocabulary [0, {model.vocab_size})")
    return params, stop


def chat_messages(request: pb.GenerateRequest) -> list[dict]:
    """The conversation of a chat request as the template expects it; INVALID_ARGUMENT names a bad message."""
    messages = request.chat.messages
    if not 1 <= len(messages) <= MAX_CHAT_MESSAGES:
        raise invalid(f"chat.messages: must hold 1 to {MAX_CHAT_MESSAGES} messages, got {len(messages)}")
    call_ids: set[str] = set()
    out = []
    for index, message in enumerate(messages):
        if not message.role or len(message.role) > 64:
            raise invalid(f"chat.messages[{index}].role: must be a non-empty name of at most 64 characters")
        out.append(template_message(message, index, call_ids))
    return out


def prompt_input(request: pb.GenerateRequest, model: SchedulerReady, chat_prompt: str | None) -> PromptText | list[int]:
    """The text to tokenize, or the token ids the request gave, checked for size before anything is tokenized.

    A chat request arrives with its conversation already rendered into `chat_prompt`."""
    which = request.WhichOneof("input")
    if which is None:
        raise invalid("prompt: give prompt (text), token_ids or chat")
    if which == "token_ids":
        return _given_token_ids(request, model)
    if which == "chat":
        prompt = PromptText("chat.messages", chat_prompt or "", add_special_tokens=False)  # the template wrote BOS
    elif not request.prompt:
        raise invalid("prompt: must not be empty")
    else:
        prompt = PromptText("prompt", request.prompt, add_special_tokens=True)
    limit = model.max_model_len * MAX_CHARS_PER_TOKEN
    if len(prompt.text) > limit:
        raise invalid(
            f"{prompt.field}: {len(prompt.text)} characters cannot fit the context of {model.max_model_len} tokens "
            f"(at most {limit} characters are tokenized)"
        )
    return prompt


def no_room(field: str, num_tokens: int, model: SchedulerReady, exact: bool = True) -> RequestError:
    count = f"{num_tokens}" if exact else f"at least {num_tokens}"
    return invalid(f"{field}: {count} tokens leave no room to generate in the context of {model.max_model_len}")


def check_tokenized(prompt: PromptText, token_ids: list[int]) -> list[int]:
    if not token_ids:
        raise invalid(f"{prompt.field}: tokenizes to no tokens")
    return token_ids


def _given_token_ids(request: pb.GenerateRequest, model: SchedulerReady) -> list[int]:
    token_ids = request.token_ids.ids
    if not token_ids:
        raise invalid("token_ids: must not be empty")
    if len(token_ids) >= model.max_model_len:  # before looking at each id: a huge list is refused at once
        raise no_room("token_ids", len(token_ids), model)
    if max(token_ids) >= model.vocab_size:
        index, token_id = next((i, t) for i, t in enumerate(token_ids) if t >= model.vocab_size)
        raise invalid(f"token_ids: id {token_id} at index {index} is outside the vocabulary [0, {model.vocab_size})")
    return list(token_ids)
