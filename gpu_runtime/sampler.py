"""Picks each sequence's next token from its logits: greedy, or temperature with top-k/top-p/min-p."""

from __future__ import annotations

import torch

from gpu_runtime.outputs import Logprob
from gpu_runtime.sequence import Sequence


class Sampler:
    """Samples a whole batch at once; only seeded rows draw their noise one by one, from their own RNG."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[Logprob | None]]:
        params = [seq.params for seq in seqs]
        greedy = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            tokens = greedy
        else:
            sampled = self._sample(logits, seqs)
            is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
            tokens = torch.where(is_greedy, greedy, sampled)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, tokens, token_list, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        device = logits.device
        temperatures = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
        scaled = logits / temperatures[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _apply_top_k_top_p(scaled, params)
        probs = scaled.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((min_p > 0).any()):
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        # The exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i
        # (unnormalised p is fine), and it lets each seeded row draw its own E from its own RNG.
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, token_list: list[int], seqs: list[Sequence]
    ) -> list[Logprob | None]:
        wanted = [seq.params.logprobs for seq in seqs]
        if all(n is None for n in wanted):
            return [None] * len(seqs)
        # Logprobs are those of the raw model distribution, before temperature and filtering (as vLLM).
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_top = max(n or 0 for n in wanted)
        top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
        results: list[Logprob | None] = []
        for row, n in enumerate(wanted):
            if n is None:
                results.append(None)
                continue
            top = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)) if n else {}
            results.append(Logprob(token_list[row], chosen[row], top))
        return results


def _apply_top_k_top_p(scaled: torch.Tensor, params) -> torch.Tensor:
    """Masks out, per row, tokens outside the top k and outside the top-p nucleus (k = 0: no limit)."""
    device = scaled.device
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    # Rows without a nucleus get an unreachable threshold: float rounding can bring the cumulative sum to
    # 1.0 before the last token, and a row that asked for nothing must lose nothing.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)
    outside = ranks[None, :] >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the probability mass before it is under top_p; the most likely always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
