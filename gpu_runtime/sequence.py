"""A request inside the engine: its tokens, its pages, and where it is in its life."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import TokenLogprob
from gpu_runtime.ipc.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import torch

    from gpu_runtime.penalties import RowTensors


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds pages and is scheduled every step
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class BlockTable:
    """Which pages hold a sequence's tokens, for the layers of one KV group."""

    page_ids: list[int] = field(default_factory=list)  # page i holds tokens [i*P, (i+1)*P)
    num_registered_pages: int = 0  # leading pages that are in the prefix cache
    # Leading pages given back because their tokens left the group's window (KVCacheManager.release_behind_window);
    # their entries now name the first page it still holds, so a kernel that reads them (masked: they are out of
    # the window) reads this sequence's own K/V.
    num_released_pages: int = 0


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int]
    priority: Priority = Priority.INTERACTIVE
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_order: int = 0  # ties in arrival_time are broken by the order add_request saw them
    admission_order: int = 0  # when it last entered the running batch; the latest is preempted first
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.prompt_logprobs: the prompt tokens' logprobs from its second token on, as the chunks that compute
    # them run (entry i scores prompt token i + 1, from position i's logits); sent with the first token.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With params.pooling (gpu_runtime.pooling): the prompt positions folded into `pooled` so far, and the running
    # pool (a [hidden] float32 sum, or the one row its pooling type reads).
    pooled_positions: int = 0
    pooled: torch.Tensor | None = None
    cache_salt: str = ""  # folded into the first page's hash: only requests with the same salt share pages
    # Its block table in each KV group (gpu_runtime/kv_cache/kv_groups.py): one, unless the model mixes sliding and
    # global layers. The first group's is page_ids, num_registered_pages and num_released_pages below.
    tables: list[BlockTable] = field(default_factory=lambda: [BlockTable()])
    # The chained content hash of each full page of its tokens, computed once as the page fills (prefix caching
    # on); they depend on content alone, so they outlive preemption.
    page_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache; written by the scheduler alone
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    first_scheduled_time: float | None = None  # when it first entered the running batch (monotonic)
    first_token_time: float | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG, so a seed's tokens ignore batch-mates
    # What its logit bias and repetition penalty need on the device (the prompt's distinct ids, the bias), made
    # by gpu_runtime.penalties on its first step that needs them and kept, rather than copied over every step.
    penalty_tensors: RowTensors | None = None
    # Its structured output's state (gpu_runtime.structured): what the grammar allows next. It has consumed
    # every output token, so a preempted sequence resumes with it as it is.
    matcher: llguidance.LLMatcher | None = None
    grammar_error: str | None = None  # why the matcher refused a token (finishes the sequence with ERROR)

    @property
    def page_ids(self) -> list[int]:
        """The first KV group's block table (every layer's, unless the model is hybrid)."""
        return self.tables[0].page_ids

    @page_ids.setter
    def page_ids(self, pages: list[int]) -> None:
        self.tables[0].page_ids = pages

    @property
    def num_registered_pages(self) -> int:
        return self.tables[0].num_registered_pages

    @num_registered_pages.setter
    def num_registered_pages(self, count: int) -> None:
        self.tables[0].num_registered_pages = count

    @property
    def num_released_pages(self) -> int:
        return self.tables[0].num_released_pages

    @num_released_pages.setter
    def num_released_pages(self, count: int) -> None:
        self.tables[0].num_released_pages = count

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_reusable_tokens(self) -> int:
        """Leading tokens whose K/V a prefix-cache hit may supply instead of a forward: all but the last (its logits
        give the next token), and, while the prompt's logprobs are wanted, only the positions already scored (a
        position the cache skips yields no logits). So a request with prompt_logprobs computes its whole prompt
        once; its pages still enter the cache for the requests after it. Mean and cls pooling likewise (their
        hidden states are not cached)."""
        reusable = self.num_tokens - 1
        if self.params.prompt_logprobs is not None:
            reusable = min(reusable, len(self.prompt_logprobs))
        if self.params.pooling is not None and self.params.pooling.reads_every_position:
            reusable = min(reusable, self.pooled_positions)
        return reusable

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def queue_key(self) -> tuple[int, float, int]:
        """The waiting queue's order: priority, then arrival (so a preempted request goes back first)."""
        return (self.priority, self.arrival_time, self.arrival_order)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        self.finish_reason = self._grammar_finish(token_id) or self._finish_reason(token_id)

    def _grammar_finish(self, token_id: int) -> FinishReason | None:
        """Advances the matcher: STOP once the grammar is complete (nothing may follow but the end), ERROR if it
        refused the token (the mask should have made that impossible)."""
        if self.matcher is None:
            return None
        if not self.matcher.consume_token(token_id) or self.matcher.is_error():
            self.grammar_error = f"structured_output: {self.matcher.get_error() or f'token {token_id} refused'}"
            return FinishReason.ERROR
        return FinishReason.STOP if self.matcher.is_stopped() else None

    def _finish_reason(self, token_id: int) -> FinishReason | None:
        if token_id in self.params.stop_token_ids:
            return FinishReason.STOP
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None
