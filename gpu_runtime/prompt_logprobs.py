"""Prompt logprobs: the log-probability the model gives each prompt token where it stands (vLLM's prompt_logprobs,
OpenAI completions' echo with logprobs), scored in the prefill chunks that compute the prompt anyway.

A chunk of positions [start, end) of a P-token prompt has the hidden states of those positions, and position p's
logits score prompt token p + 1: the chunk scores tokens start + 1 .. min(end, P - 1). (The last prompt position's
logits are its sampling row's: they pick the first output token.) The prompt's first token has no logprob, as in
OpenAI's and vLLM's answers. A sequence scores each position once, preemption or not (Sequence.prompt_logprobs
counts how far it got), and a prefix-cache hit never skips an unscored position (Sequence.num_reusable_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from gpu_runtime.ipc.messages import TokenLogprob

if TYPE_CHECKING:
    from gpu_runtime.model.registry import CausalLM
    from gpu_runtime.sequence import Sequence

# Rows turned into vocabulary-wide logits at once: a long chunk never holds more than this many [vocab] float32
# rows (256 rows of a 152k vocabulary: 155 MB).
ROWS_PER_SLICE = 256


@dataclass(frozen=True, slots=True)
class ScoredPrompt:
    """One sequence's scored rows in a step, in row order: `count` of them, from its first unscored position."""

    seq: Sequence
    count: int


class PromptScores(NamedTuple):
    logprobs: torch.Tensor  # [rows] float32: each scored token's logprob
    top_ids: torch.Tensor | None  # [rows, top]: the most likely tokens at each row, when some sequence wants them
    top_logprobs: torch.Tensor | None


def rows_to_score(seq: Sequence, start: int, end: int, first_row: int) -> tuple[list[int], list[int]]:
    """The flat batch rows of the chunk [start, end) (its first position at `first_row`) that score a prompt token
    not scored yet, and those tokens."""
    first = max(start, len(seq.prompt_logprobs))
    last = min(end, seq.num_prompt_tokens - 1)
    if first >= last:
        return [], []
    return [first_row + p - start for p in range(first, last)], seq.prompt_token_ids[first + 1 : last + 1]


@torch.inference_mode()
def score_rows(model: CausalLM, hidden: torch.Tensor, targets: torch.Tensor, top: int) -> PromptScores | None:
    """The logprobs of `targets` [rows] under the logits of `hidden` [rows, hidden], and the `top` most likely tokens
    of each row, computed ROWS_PER_SLICE rows at a time. Every tensor-parallel rank runs it (compute_logits gathers
    across them); the ranks other than 0 get None."""
    chosen, top_ids, top_values = [], [], []
    for start in range(0, hidden.shape[0], ROWS_PER_SLICE):
        logits = model.compute_logits(hidden[start : start + ROWS_PER_SLICE])
        if logits is None:
            continue
        logprobs = logits.log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, targets[start : start + ROWS_PER_SLICE, None]).squeeze(1))
        if top:
            values, ids = logprobs.topk(top, dim=-1)
            top_values.append(values)
            top_ids.append(ids)
    if not chosen:
        return None
    if not top:
        return PromptScores(torch.cat(chosen), None, None)
    return PromptScores(torch.cat(chosen), torch.cat(top_ids), torch.cat(top_values))


def append_scores(scored: list[ScoredPrompt], scores: PromptScores) -> None:
    """Appends the step's new prompt logprobs to each scored sequence (reading them off the device once)."""
    values = scores.logprobs.tolist()
    ids = scores.top_ids.tolist() if scores.top_ids is not None else None
    tops = scores.top_logprobs.tolist() if scores.top_logprobs is not None else None
    row = 0
    for item in scored:
        seq, wanted = item.seq, item.seq.params.prompt_logprobs or 0
        for index in range(row, row + item.count):
            token = seq.prompt_token_ids[len(seq.prompt_logprobs) + 1]
            top = list(zip(ids[index][:wanted], tops[index][:wanted], strict=True)) if wanted else []
            seq.prompt_logprobs.append(TokenLogprob(token, values[index], top))
        row += item.count
