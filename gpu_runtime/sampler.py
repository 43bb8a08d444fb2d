"""Picks each sequence's next token from its logits: logit bias and penalties first (gpu_runtime.penalties), then
greedy, or temperature with top-k/top-p/min-p."""

from __future__ import annotations

import torch

from gpu_runtime.ipc.messages import TokenLogprob
from gpu_runtime.penalties import apply_logit_adjustments
from gpu_runtime.sequence import Sequence

# Tokens looked at for a top-p nucleus: first the best 64 (a confident next token's nucleus), then the best
# 1024 (an uncertain one's), then all. torch.topk of 64 or 1024 of 32,000 costs 1/30 or 1/7 of a full sort.
_FIRST_NUCLEUS_GUESS = 64
_WIDE_NUCLEUS_GUESS = 1024


class Sampler:
    """Samples a whole batch at once; only seeded rows draw their random number one by one, from their own RNG."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        wants_logprobs = any(seq.params.logprobs is not None for seq in seqs)
        # Logprobs are those of the raw model distribution (as vLLM's by default): the adjustments work on a
        # copy when some row wants them, else in place.
        adjusted = apply_logit_adjustments(logits, seqs, in_place=not wants_logprobs)
        tokens = adjusted.argmax(dim=-1)
        sampling_rows = [row for row, seq in enumerate(seqs) if not seq.params.is_greedy]
        if sampling_rows:  # only the rows that sample pay for it: greedy ones keep their argmax
            rows = torch.tensor(sampling_rows, device=logits.device)
            tokens[rows] = self._sample(adjusted[rows], [seqs[row] for row in sampling_rows])
        token_list = tokens.tolist()
        if not wants_logprobs:
            return token_list, [None] * len(seqs)
        return token_list, self._logprobs(logits, tokens, token_list, seqs)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        device = logits.device
        temperatures = torch.tensor([p.temperature for p in params], device=device)
        scaled = logits / temperatures[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            scaled = _apply_top_k_top_p(scaled, params)
        probs = scaled.softmax(dim=-1)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        if bool((min_p > 0).any()):
            floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return _inverse_cdf(probs, _uniforms(seqs, device))

    def _logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, token_list: list[int], seqs: list[Sequence]
    ) -> list[TokenLogprob | None]:
        wanted = [seq.params.logprobs for seq in seqs]
        # Logprobs are those of the raw model distribution, before temperature and filtering (as vLLM).
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_top = max(n or 0 for n in wanted)
        top_values, top_ids = logprobs.topk(max_top, dim=-1) if max_top else (None, None)
        results: list[TokenLogprob | None] = []
        for row, n in enumerate(wanted):
            if n is None:
                results.append(None)
                continue
            top = list(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True)) if n else []
            results.append(TokenLogprob(token_list[row], chosen[row], top))
        return results


def _apply_top_k_top_p(scaled: torch.Tensor, params) -> torch.Tensor:
    """Masks out, per row, tokens outside the top k and outside the top-p nucleus (k = 0: no limit).

    Both filters keep a prefix of the row sorted by logit, so each comes down to a cutoff logit, found from
    the row's best few tokens (torch.topk) rather than a sort of the whole vocabulary: a sort of 32 rows of
    32,000 took about 40 ms on a 2-core CPU, more than the decode step it served; the top 64 take about 1.
    Only when a row's nucleus reaches past the tokens looked at are more of them taken.
    """
    device = scaled.device
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    # Rows without a nucleus get an unreachable threshold: float rounding can bring the cumulative sum to
    # 1.0 before the last token, and a row that asked for nothing must lose nothing.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    wants_nucleus = any(p.top_p < 1.0 for p in params)
    # The log of each row's total mass once top-k has cut it: over the top k alone where k is set, else all.
    log_total_all = scaled.logsumexp(dim=-1, keepdim=True) if wants_nucleus else None
    filtered = torch.tensor([p.top_k > 0 or p.top_p < 1.0 for p in params], device=device)
    looked_at = min(vocab, max(_tokens_to_look_at(p) for p in params))
    while True:
        best, _ = scaled.topk(looked_at, dim=-1)  # [rows, looked_at], descending
        ranks = torch.arange(looked_at, device=device)
        best = best.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
        if not wants_nucleus:
            break
        has_k = (top_k <= looked_at)[:, None]
        log_total = torch.where(has_k, best.logsumexp(dim=-1, keepdim=True), log_total_all)
        probs = (best - log_total).exp()
        mass = probs.cumsum(dim=-1)
        # Keep a token while the probability mass before it is under top_p; the most likely always stays.
        best = best.masked_fill(mass - probs >= top_p[:, None], float("-inf"))
        # Enough tokens were looked at once each row's nucleus closes inside them (or ends with its top k).
        if looked_at == vocab or bool((has_k.squeeze(1) | (mass[:, -1] >= top_p)).all()):
            break
        looked_at = min(vocab, _WIDE_NUCLEUS_GUESS) if looked_at < _WIDE_NUCLEUS_GUESS else vocab
    kept = best.isfinite()
    cutoff = best.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values  # the last kept logit
    cutoff = cutoff.masked_fill(~filtered[:, None], float("-inf"))  # a row that asked for nothing keeps all
    return scaled.masked_fill(scaled < cutoff, float("-inf"))


def _tokens_to_look_at(params) -> int:
    """How many of a row's best tokens decide its filters: its top k (which also normalises its nucleus), or
    else a first guess at its nucleus; 0 when it asks for neither."""
    if params.top_k > 0:
        return params.top_k
    return _FIRST_NUCLEUS_GUESS if params.top_p < 1.0 else 0


def _uniforms(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
    """[rows, 1] draws in [0, 1): a seeded row's from its own RNG, so its tokens ignore its batch-mates."""
    uniforms = torch.rand(len(seqs), 1, device=device)
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            uniforms[row] = torch.rand(1, generator=seq.generator, device=device)
    return uniforms


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative (unnormalised) mass passes uniform * total mass.

    One random number per row rather than one per vocabulary entry (the exponential race): on a 2-core CPU,
    drawing 32,000 exponentials a row took a sixth of a batch-32 decode step. A token of zero mass adds
    nothing to the cumulative sum, so no draw can land on it.
    """
    cumulative = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True).squeeze(1)
    past_end = tokens >= probs.shape[-1]  # uniform * total rounded up to the total itself: rare, but possible
    if bool(past_end.any()):
        tokens = torch.where(past_end, probs.argmax(dim=-1), tokens)
    return tokens
