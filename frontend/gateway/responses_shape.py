"""A Responses API response built from the frontend's chunks: the final object, and the stream's events in the order
the `openai` SDK's `responses.stream()` reads them (created, in_progress, output items added, text and argument
deltas, their done events, then completed, or incomplete when max_output_tokens cut the turn)."""

from __future__ import annotations

import time
import uuid

from frontend.gateway.responses_request import ResponsesRequest
from tokend.v1 import tokend_pb2 as pb


class ResponsesShape:
    def __init__(self, request: ResponsesRequest, model: str, request_id: str | None):
        self.id = f"resp_{request_id or uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self._request = request
        self._sequence = 0
        self._output: list[dict] = []
        self._message: dict | None = None  # the turn's text, one message item
        self._calls: dict[int, dict] = {}  # tool call index -> its function_call item
        self._usage: pb.Usage | None = None
        self._finish_reason = ""

    # -- the stream -------------------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.body("in_progress")),
                self._event("response.in_progress", response=self.body("in_progress"))]  # fmt: skip

    def chunk(self, response: pb.GenerateResponse) -> list[dict]:
        """Records one frontend chunk; the events it makes."""
        self.model = response.model or self.model
        self._usage = response.usage
        self._finish_reason = response.finish_reason or self._finish_reason
        events = []
        if response.text:
            if self._message is None:
                events += self._open_message()
            part = self._message["content"][0]
            part["text"] += response.text
            events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                      output_index=self._index(self._message), content_index=0, delta=response.text,
                                      logprobs=[]))  # fmt: skip
        for delta in response.tool_calls:
            item = self._calls.get(delta.index)
            if item is None:
                item = self._calls[delta.index] = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}",
                                                   "call_id": delta.id, "name": delta.name, "arguments": "",
                                                   "status": "in_progress"}  # fmt: skip
                self._output.append(item)
                events.append(
                    self._event("response.output_item.added", output_index=self._index(item), item=dict(item))
                )
            item["arguments"] += delta.arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(item), delta=delta.arguments))  # fmt: skip
        return events

    def finish(self) -> list[dict]:
        events = []
        if self._message is not None:
            index, part = self._index(self._message), self._message["content"][0]
            self._message["status"] = "completed"
            ids = {"item_id": self._message["id"], "output_index": index, "content_index": 0}
            events += [self._event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", **ids, part=dict(part)),
                       self._event("response.output_item.done", output_index=index, item=self._message)]  # fmt: skip
        for item in self._calls.values():
            item["status"] = "completed"
            index = self._index(item)
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   arguments=item["arguments"], name=item["name"]),
                       self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        status = self._status()
        events.append(self._event(f"response.{status}", response=self.body(status)))
        return events

    # -- the object -------------------------------------------------------------------------------------------

    def body(self, status: str | None = None) -> dict:
        status = status or self._status()
        request = self._request
        usage = self._usage or pb.Usage()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": self._output if status not in ("in_progress",) else [],
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            },
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "tools": request.tools or [],
            "tool_choice": request.tool_choice or "auto",
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "text": request.text or {"format": {"type": "text"}},
            "metadata": request.metadata or {},
            "previous_response_id": None,
            "store": False,
        }

    def _status(self) -> str:
        return "incomplete" if self._finish_reason == "length" else "completed"

    def _open_message(self) -> list[dict]:
        self._message = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                         "role": "assistant", "content": []}  # fmt: skip
        self._output.append(self._message)
        index = self._index(self._message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._event("response.output_item.added", output_index=index, item={**self._message, "content": []})
        self._message["content"].append(part)
        return [added, self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                   content_index=0, part=dict(part))]  # fmt: skip

    def _index(self, item: dict) -> int:
        return next(index for index, candidate in enumerate(self._output) if candidate is item)

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence, **fields}
