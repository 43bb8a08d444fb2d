"""What the engine returns: RequestOutput and CompletionOutput, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """The log-probability of one sampled token under the model, and optionally the top candidates."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)  # token id -> logprob, most likely first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort", None while running
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One request's progress in one engine step: the tokens it gained, and why it ended if it did."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache instead of computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
