"""ChunkBuilder: turns one request's scheduler deltas into GenerateResponse chunks (text, usage, finish)."""

from __future__ import annotations

from frontend.text_stream import IncrementalDetokenizer, StopStringMatcher
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import RequestDelta
from gpu_runtime.tokenizer import Tokenizer
from tokend.v1 import tokend_pb2 as pb


class ChunkBuilder:
    """Detokenizes incrementally, cuts at stop strings, and keeps the scheduler's latest counts (`last_delta`)."""

    def __init__(self, request_id: str, model_name: str, tokenizer: Tokenizer, stop: list[str]):
        self.request_id = request_id
        self.model_name = model_name
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer.backend)
        self._stop = StopStringMatcher(stop)
        self.last_delta: RequestDelta | None = None  # its counts are what the request cost so far
        self.finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stopped_by_string(self) -> bool:
        return self._stop.matched is not None

    def build(self, deltas: list[RequestDelta]) -> pb.GenerateResponse:
        self.last_delta = last = deltas[-1]
        token_ids = [token for delta in deltas for token in delta.new_token_ids]
        text = self._stop.push(self._detokenizer.push(token_ids))
        finish_reason = last.finish_reason
        if finish_reason is not None and self._stop.matched is None:
            text += self._stop.push(self._detokenizer.finish())
            text += self._stop.flush()
        if self._stop.matched is not None:
            finish_reason = FinishReason.STOP
        self.finish_reason = finish_reason
        usage = pb.Usage(
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=last.num_output_tokens,
            cached_tokens=last.num_cached_tokens,
        )
        return pb.GenerateResponse(
            request_id=self.request_id,
            token_ids=token_ids,
            text=text,
            usage=usage,
            finish_reason=finish_reason or "",
            logprobs=self._logprobs(deltas),
            model=self.model_name,
        )

    def _logprobs(self, deltas: list[RequestDelta]) -> list[pb.TokenLogprob]:
        text = self._tokenizer.token_text
        return [
            pb.TokenLogprob(
                token_id=entry.token_id,
                logprob=entry.logprob,
                token=text(entry.token_id),
                top=[pb.TopLogprob(token_id=token, logprob=value, token=text(token)) for token, value in entry.top],
            )
            for delta in deltas
            if delta.new_logprobs
            for entry in delta.new_logprobs
        ]
