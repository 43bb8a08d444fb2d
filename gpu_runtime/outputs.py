"""What the offline API returns: RequestOutput and CompletionOutput (EmbeddingRequestOutput for embed), shaped like
vLLM's.

The engine's own per-step output is gpu_runtime.ipc.messages.RequestDelta, the very struct the frontend reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import TokenLogprob


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (as vLLM's).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
