"""ChunkBuilder: turns one request's scheduler deltas into GenerateResponse chunks (text, usage, finish)."""

from __future__ import annotations

from frontend.metering import TokenCounts
from frontend.text_stream import IncrementalDetokenizer, StopStringMatcher
from frontend.tool_calls.calls import CallReader
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import RequestDelta, TokenLogprob
from gpu_runtime.tokenizer import Tokenizer
from tokend.v1 import tokend_pb2 as pb


class ChunkBuilder:
    """Detokenizes incrementally and cuts at stop strings. Which delta ends the request, and what it cost so far,
    is its session's to say (a worker's final delta may hand the request on to the next worker)."""

    def __init__(
        self, request_id: str, model_name: str, tokenizer: Tokenizer, stop: list[str], calls: CallReader | None = None
    ):
        self.request_id = request_id
        self.model_name = model_name
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer.backend)
        self._stop = StopStringMatcher(stop)
        self._calls = calls  # reads tool calls out of the text (a chat request with tools)
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self._stop.matched is not None

    def build(
        self, deltas: list[RequestDelta], counts: TokenCounts, finish_reason: FinishReason | None
    ) -> pb.GenerateResponse:
        """The chunk of these deltas: `counts` is the request's cost so far, `finish_reason` set when they end
        the request (a stop string found here ends it too)."""
        token_ids = [token for delta in deltas for token in delta.new_token_ids]
        text = self._stop.push(self._detokenizer.push(token_ids))
        if finish_reason is not None and self._stop.matched is None:
            text += self._stop.push(self._detokenizer.finish())
            text += self._stop.flush()
        if self._stop.matched is not None:
            finish_reason = FinishReason.STOP
        self.finish_reason = finish_reason
        calls = []
        if self._calls is not None:
            piece = self._calls.feed(text)
            if finish_reason is not None:
                piece += self._calls.finish()
            text, calls = piece.content, piece.calls
        usage = pb.Usage(
            prompt_tokens=counts.prompt_tokens,
            completion_tokens=counts.completion_tokens,
            cached_tokens=counts.cached_tokens,
        )
        return pb.GenerateResponse(
            request_id=self.request_id,
            token_ids=token_ids,
            text=text,
            usage=usage,
            finish_reason=self._finish_label(finish_reason),
            logprobs=self._as_pb([entry for delta in deltas for entry in delta.new_logprobs or ()]),
            prompt_logprobs=self._as_pb([entry for delta in deltas for entry in delta.prompt_logprobs or ()]),
            model=self.model_name,
            tool_calls=[pb.ToolCallDelta(index=c.index, id=c.id, name=c.name, arguments=c.arguments) for c in calls],
        )

    def _finish_label(self, finish_reason: FinishReason | None) -> str:
        """The API's finish_reason: "tool_calls" for a turn that stopped after calling tools."""
        if finish_reason is FinishReason.STOP and self._calls is not None and self._calls.num_calls:
            return "tool_calls"
        return finish_reason or ""

    def _as_pb(self, entries: list[TokenLogprob]) -> list[pb.TokenLogprob]:
        text = self._tokenizer.token_text
        return [
            pb.TokenLogprob(
                token_id=entry.token_id,
                logprob=entry.logprob,
                token=text(entry.token_id),
                top=[pb.TopLogprob(token_id=token, logprob=value, token=text(token)) for token, value in entry.top],
            )
            for entry in entries
        ]
