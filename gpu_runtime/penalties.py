"""Logit bias and the repetition, frequency and presence penalties, for a whole batch at once.

The definitions and their order are vLLM's (its sampler applies the logit bias, then
`vllm/model_executor/layers/utils.py: apply_penalties`), so a request means the same here as there:

- logit_bias: the bias is added to its token's logit;
- repetition_penalty (transformers' and vLLM's): a token seen in the prompt or the output so far has its logit
  divided by the penalty when positive, multiplied by it otherwise (divided, as transformers does: vLLM's torch
  fallback multiplies by the reciprocal, which can differ in the last bit);
- frequency_penalty, then presence_penalty (OpenAI's): a token's logit loses frequency_penalty times the number
  of times it was generated so far, then presence_penalty once if it was generated at all (the prompt does not
  count for these two).

Only the logits of tokens a row has seen are touched: the batch's seen tokens become flat indices (row * vocab +
id) into the logits, gathered, changed and scattered back in a few batched kernels, with the output's counts
from one torch.unique. So the cost follows the length of the rows' histories, not the vocabulary: vLLM's dense
way (a [rows, vocab] count tensor, then a dozen passes over all the logits) took 3-7 times longer on a CPU for
32 rows of 32,000 tokens with 768-token histories. The arithmetic on each touched logit is the dense way's, so
the results are the same bit for bit. What never changes in a row (its prompt's distinct ids, its bias) is
kept on its sequence as device tensors (RowTensors), so that a long prompt or a 300-token bias is not copied to
the device at every step; the output's ids grow by one a step, and are taken from the sequence each time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from gpu_runtime.sequence import Sequence


# The model's logits are inference tensors, which only inference mode may update in place.
@torch.inference_mode()
def apply_logit_adjustments(logits: torch.Tensor, seqs: list[Sequence], in_place: bool) -> torch.Tensor:
    """`logits` [rows, vocab] with each row's logit bias and penalties applied; the same tensor, untouched, when
    no row asks for any (the common case costs one look at each row's params). Without `in_place` the result
    is a copy, so the raw logits stay for the logprobs."""
    rows = [row for row, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    # _adjust works on a flat view of the rows, so a strided tensor is copied whatever `in_place` says.
    in_place = in_place and logits.is_contiguous()
    adjusted = logits if in_place else logits.clone(memory_format=torch.contiguous_format)
    if len(rows) == len(seqs):  # every row asks: no gather and scatter of the rows that do
        _adjust(adjusted, seqs)
        return adjusted
    index = torch.tensor(rows, device=logits.device)
    subset = adjusted.index_select(0, index)
    _adjust(subset, [seqs[row] for row in rows])
    adjusted.index_copy_(0, index, subset)
    return adjusted


def _adjust(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Applies every row's bias and penalties to the contiguous `logits` in place; each kind runs only if some
    row uses it, and only on the rows that do."""
    params = [seq.params for seq in seqs]
    device = logits.device
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    biased = [row for row, p in enumerate(params) if p.logit_bias]
    if biased:
        fixed = [_row_tensors(seqs[row], device) for row in biased]
        rows = _repeat(biased, [len(t.bias_ids) for t in fixed], device)
        # Each row's ids are distinct (SamplingParams checks), so each bias is added exactly once.
        flat[rows * vocab + torch.cat([t.bias_ids for t in fixed])] += torch.cat([t.bias_values for t in fixed])
    repeating = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeating:
        prompt_sets = [_row_tensors(seqs[row], device).prompt_ids for row in repeating]
        outputs = [seqs[row].output_token_ids for row in repeating]
        ids = torch.cat([*prompt_sets, _tensor(list(itertools.chain.from_iterable(outputs)), device)])
        rows = torch.cat(
            [_repeat(repeating, [len(s) for s in prompt_sets], device), _repeat(repeating, map(len, outputs), device)]
        )
        index = rows * vocab + ids
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[rows]
        # A token both in the prompt and the output (or twice in the output) is indexed more than once: each
        # copy is computed from the same gathered logit and writes the same value, so it is penalised once.
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    counting = [row for row, p in enumerate(params) if p.frequency_penalty or p.presence_penalty]
    if counting:
        outputs = [seqs[row].output_token_ids for row in counting]
        ids = _tensor(list(itertools.chain.from_iterable(outputs)), device)
        seen, counts = torch.unique(_repeat(counting, map(len, outputs), device) * vocab + ids, return_counts=True)
        rows = seen // vocab
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[rows]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[rows]
        # vLLM's two subtractions, in its order: frequency times the count, then presence once.
        flat[seen] = flat[seen] - frequency * counts - presence


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _repeat(values: list[int], counts: Iterable[int], device: torch.device) -> torch.Tensor:
    """Each value repeated its count's times, in one kernel: [a, a, a, b, ...]."""
    return torch.repeat_interleave(_tensor(values, device), _tensor(list(counts), device))


@dataclass(frozen=True, slots=True)
class RowTensors:
    """What a row's adjustments need on the device that never changes during its life: built on its first
    adjusted step and kept on its Sequence, so a long prompt or a long bias is not copied over at every step."""

    prompt_ids: torch.Tensor  # the prompt's distinct ids; empty unless a repetition penalty needs them
    bias_ids: torch.Tensor
    bias_values: torch.Tensor  # float32, as the model's logits


def _row_tensors(seq: Sequence, device: torch.device) -> RowTensors:
    if seq.penalty_tensors is None:
        params = seq.params
        prompt = sorted(set(seq.prompt_token_ids)) if params.repetition_penalty != 1.0 else []
        seq.penalty_tensors = RowTensors(
            prompt_ids=_tensor(prompt, device),
            bias_ids=_tensor([token_id for token_id, _ in params.logit_bias], device),
            bias_values=torch.tensor([bias for _, bias in params.logit_bias], dtype=torch.float32, device=device),
        )
    return seq.penalty_tensors
