"""Builds OpenAI response bodies and stream chunks from the frontend's GenerateResponse chunks."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field

from tokend.v1 import tokend_pb2 as pb


@dataclass(slots=True)
class ChoiceState:
    """One choice's progress: its text so far, logprobs, counts and finish reason."""

    index: int
    text: list[str] = field(default_factory=list)
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)
    usage: pb.Usage | None = None
    finish_reason: str | None = None
    text_offset: int = 0  # characters emitted so far (completions logprobs' text_offset)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per prompt token, when asked for
    tool_calls: dict[int, dict] = field(default_factory=dict)  # by index: OpenAI's call objects, arguments joined


class ResponseShape:
    """The id, timestamps and model every chunk and body of one response repeats; completions or chat.

    A response has `n` choices: `per_prompt` for each of its prompts (completions take a batch of prompts), so that
    choice `index` answers prompt `index // per_prompt`."""

    def __init__(
        self,
        chat: bool,
        model: str,
        n: int,
        include_usage: bool,
        wants_logprobs: bool,
        request_id: str | None = None,
        per_prompt: int | None = None,
        echo: list[str] | None = None,
        prompt_logprobs: bool = False,
    ):
        self.chat = chat
        # OpenAI's id shape around the request's id: the one a client sent as X-Request-Id finds it here too.
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.wants_logprobs = wants_logprobs
        self.choices = [ChoiceState(i) for i in range(n)]
        self.per_prompt = per_prompt or n
        # Completions' echo: each prompt's text, put before its choices' text (and, with logprobs, its tokens'
        # logprobs before theirs); vLLM's prompt_logprobs field, when the request set it.
        self.echo = echo
        self.wants_prompt_logprobs = prompt_logprobs
        # OpenAI's name for what identifies the backend that served: here the weights' generation (a rollout
        # changes it), so a client can tell which weights answered.
        self.system_fingerprint: str | None = None

    # -- streaming ----------------------------------------------------------------------------------------------

    def chunk(self, index: int, response: pb.GenerateResponse) -> dict:
        """Records a frontend chunk and returns the OpenAI chunk for it."""
        choice = self.choices[index]
        if response.model:
            self.model = response.model
        if response.generation:
            self.system_fingerprint = response.generation
        first = not choice.text
        if response.prompt_logprobs:
            choice.prompt_logprobs = list(response.prompt_logprobs)
        entries = list(response.logprobs)
        text = response.text
        if first and self.echo is not None:
            text = self.echo[index // self.per_prompt] + text
            entries = choice.prompt_logprobs + entries
        logprobs = self._logprobs(choice, entries) if self.wants_logprobs else None
        choice.text.append(text)
        choice.logprobs.extend(entries)
        choice.usage = response.usage
        choice.finish_reason = response.finish_reason or None
        if self.chat:
            # The role rides on the choice's first token, never ahead of it: clients that time the first token
            # by the first chunk (vLLM's benchmark does) would otherwise time the end of admission, not of prefill.
            delta = {"role": "assistant", "content": response.text} if first else {"content": response.text}
            if response.tool_calls:
                delta["tool_calls"] = [_call_delta(call) for call in response.tool_calls]
                _record_calls(choice, response.tool_calls)
            entry = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            entry = {"index": index, "text": text, "logprobs": logprobs}
        entry["finish_reason"] = choice.finish_reason
        if first and self.wants_prompt_logprobs:
            entry["prompt_logprobs"] = _vllm_prompt_logprobs(choice.prompt_logprobs)
        return self._chunk([entry])

    def usage_chunk(self) -> dict:
        return {**self._header(), "choices": [], "usage": self.usage()}

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {**self._header(), "choices": choices}
        if self.include_usage:
            chunk["usage"] = None  # as OpenAI: only the last chunk carries usage
        return chunk

    def _header(self) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint}  # fmt: skip

    # -- whole bodies -------------------------------------------------------------------------------------------

    def body(self) -> dict:
        choices = []
        for choice in self.choices:
            text = "".join(choice.text)
            logprobs = self._logprobs(ChoiceState(choice.index), choice.logprobs) if self.wants_logprobs else None
            entry = {"index": choice.index, "logprobs": logprobs, "finish_reason": choice.finish_reason}
            if self.chat:
                entry["message"] = {"role": "assistant", "content": text}
                if choice.tool_calls:  # as OpenAI: content null when the turn is calls alone
                    calls = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
                    entry["message"] = {"role": "assistant", "content": text or None, "tool_calls": calls}
            else:
                entry["text"] = text
                if self.wants_prompt_logprobs:
                    entry["prompt_logprobs"] = _vllm_prompt_logprobs(choice.prompt_logprobs)
            choices.append(entry)
        kind = "chat.completion" if self.chat else "text_completion"
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.chat and self.wants_prompt_logprobs:  # vLLM's place for it in a chat answer: the body (one prompt)
            body["prompt_logprobs"] = _vllm_prompt_logprobs(self.choices[0].prompt_logprobs)
        return body

    def usage(self) -> dict:
        """Each prompt is counted once, however many choices it had; completions add up."""
        prompt = cached = completion = 0
        for first in range(0, len(self.choices), self.per_prompt):
            usages = [c.usage for c in self.choices[first : first + self.per_prompt] if c.usage is not None]
            prompt += usages[0].prompt_tokens if usages else 0
            cached += usages[0].cached_tokens if usages else 0
            completion += sum(u.completion_tokens for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- logprobs -----------------------------------------------------------------------------------------------

    def _logprobs(self, choice: ChoiceState, entries: list[pb.TokenLogprob]) -> dict:
        if self.chat:
            return {
                "content": [
                    {
                        "token": e.token,
                        "logprob": e.logprob,
                        "bytes": list(e.token.encode()),
                        "top_logprobs": [
                            {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())} for t in e.top
                        ],
                    }
                    for e in entries
                ]
            }
        offsets = []
        for entry in entries:
            offsets.append(choice.text_offset)
            choice.text_offset += len(entry.token)
        # An echoed prompt's first token has no logprob (NaN on the wire): null, and null top_logprobs, as OpenAI's.
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [None if math.isnan(e.logprob) else e.logprob for e in entries],
            "top_logprobs": [None if math.isnan(e.logprob) else {t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }


def _vllm_prompt_logprobs(entries: list[pb.TokenLogprob]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, decoded_token}} for
    the prompt's token and the most likely ones there."""
    shaped: list[dict | None] = []
    for entry in entries:
        if math.isnan(entry.logprob):
            shaped.append(None)
            continue
        top = {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.token} for t in entry.top}
        shaped.append({str(entry.token_id): {"logprob": entry.logprob, "decoded_token": entry.token}, **top})
    return shaped


def _call_delta(call: pb.ToolCallDelta) -> dict:
    """A call's piece in OpenAI's chunk shape: index always; id, type and name with its first piece."""
    delta: dict = {"index": call.index}
    function: dict = {"arguments": call.arguments}
    if call.id:
        delta |= {"id": call.id, "type": "function"}
        function["name"] = call.name
    delta["function"] = function
    return delta


def _record_calls(choice: ChoiceState, calls) -> None:
    for call in calls:
        entry = choice.tool_calls.setdefault(call.index, {"id": "", "type": "function",
                                                          "function": {"name": "", "arguments": ""}})  # fmt: skip
        entry["id"] = call.id or entry["id"]
        entry["function"]["name"] = call.name or entry["function"]["name"]
        entry["function"]["arguments"] += call.arguments
