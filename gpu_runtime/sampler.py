"""Picks each sequence's next token from its logits: logit bias and penalties first (gpu_runtime.penalties), then
greedy, or temperature with top-k/top-p/min-p.

Written for an accelerator that runs ahead of the host: every branch is decided on the host from the requests'
parameters (never by reading a device value), the rows' parameters and random numbers go to the device in one
copy, and the tokens (with their logprobs) come back in one read at the end of the step. Seeded rows draw their
random number from a CPU generator, so a seed gives the same draws on every device.
"""

from __future__ import annotations

import torch

from gpu_runtime.ipc.messages import TokenLogprob
from gpu_runtime.penalties import apply_logit_adjustments
from gpu_runtime.sequence import Sequence

# Tokens looked at for a top-p nucleus on a CPU: first the best 64 (a confident next token's nucleus), then the
# best 1024 (an uncertain one's), then all. torch.topk of 64 or 1024 of 32,000 costs 1/30 or 1/7 of a full sort.
# Each widening is decided by reading the device, which is free on a CPU but would stall an accelerator's queue:
# there the whole vocabulary is looked at in one pass (a sort is cheap there, a stall is not).
_FIRST_NUCLEUS_GUESS = 64
_WIDE_NUCLEUS_GUESS = 1024

# The columns of the per-row table copied to the device once per step.
_TEMPERATURE, _TOP_K, _TOP_P, _FILTERED, _MIN_P, _UNIFORM, _ROW = range(7)


class Sampler:
    """Samples a whole batch at once; a seeded row draws its random number from its own generator, a CPU one
    (Sequence.generator, made by the engine) whatever the logits' device."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        wanted = [seq.params.logprobs for seq in seqs]
        host = self.on_device(logits, seqs).tolist()  # the step's one read of the device
        if all(n is None for n in wanted):
            return host, [None] * len(seqs)
        return _unpack_logprobs(host, wanted)

    @torch.inference_mode()
    def on_device(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The batch's tokens [rows] as a device tensor, or, when a row wants logprobs, [rows, 2 + 2 x top n]
        float64 (see _logprob_table); nothing here reads the device, so an accelerator's queue never stalls."""
        wanted = [seq.params.logprobs for seq in seqs]
        wants_logprobs = any(n is not None for n in wanted)
        # Logprobs are those of the raw model distribution (as vLLM's by default): the adjustments work on a
        # copy when some row wants them, else in place.
        adjusted = apply_logit_adjustments(logits, seqs, in_place=not wants_logprobs)
        sampling_rows = [row for row, seq in enumerate(seqs) if not seq.params.is_greedy]
        if sampling_rows and len(sampling_rows) == len(seqs):  # no argmax, no gather
            table = _row_table(seqs, sampling_rows, logits.shape[-1], logits.device)
            tokens = _sample_rows(adjusted, table, [seq.params for seq in seqs])
        else:
            tokens = adjusted.argmax(dim=-1)
            if sampling_rows:  # only the rows that sample pay for it: greedy ones keep their argmax
                table = _row_table([seqs[row] for row in sampling_rows], sampling_rows, logits.shape[-1], logits.device)
                rows = table[:, _ROW].long()
                tokens[rows] = _sample_rows(adjusted[rows], table, [seqs[row].params for row in sampling_rows])
        return _logprob_table(logits, tokens, wanted) if wants_logprobs else tokens


def _row_table(seqs: list[Sequence], rows: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, 7] float32 on the device: each sampling row's temperature, top k (vocab when unset), top p (inf when
    unset: float rounding can bring the cumulative sum to 1.0 before the last token, and a row that asked for
    nothing must lose nothing), whether it filters, min p, its uniform draw and its row in the batch; built on
    the host and copied over once. float32 holds every id and k exactly (below 2^24) and is the logits' type."""
    params = [seq.params for seq in seqs]
    table = torch.tensor(
        [
            [
                p.temperature,
                p.top_k or vocab,
                p.top_p if p.top_p < 1.0 else float("inf"),
                float(p.top_k > 0 or p.top_p < 1.0),
                p.min_p,
                uniform,
                row,
            ]
            for p, uniform, row in zip(params, _uniforms(seqs).tolist(), rows, strict=True)
        ],
        dtype=torch.float32,
    )
    return _to_device(table, device)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One host-to-device copy that does not wait for the device: from pinned memory on CUDA, which the caching
    host allocator keeps alive until the copy has run."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def _uniforms(seqs: list[Sequence]) -> torch.Tensor:
    """[rows] draws in [0, 1) on the CPU: the batch's from the global RNG, a seeded row's from its own, so its
    tokens ignore its batch-mates and its device."""
    uniforms = torch.rand(len(seqs))
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            uniforms[row] = torch.rand(1, generator=seq.generator)
    return uniforms


def _sample_rows(logits: torch.Tensor, table: torch.Tensor, params: list) -> torch.Tensor:
    """Each row's token: temperature, then its filters, then one inverse-CDF draw with its uniform."""
    scaled = logits / table[:, _TEMPERATURE, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        scaled = _apply_top_k_top_p(scaled, table, params)
    probs = scaled.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):  # a row with min_p 0 has a floor of 0: it loses nothing
        floor = table[:, _MIN_P, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return _inverse_cdf(probs, table[:, _UNIFORM, None])


def _apply_top_k_top_p(scaled: torch.Tensor, table: torch.Tensor, params: list) -> torch.Tensor:
    """Masks out, per row, tokens outside the top k and outside the top-p nucleus (k = 0: no limit).

    Both filters keep a prefix of the row sorted by logit, so each comes down to a cutoff logit, found from
    the row's best few tokens (torch.topk) rather than a sort of the whole vocabulary: a sort of 32 rows of
    32,000 took about 40 ms on a 2-core CPU, more than the decode step it served; the top 64 take about 1.
    On a CPU, only when a row's nucleus reaches past the tokens looked at are more of them taken.
    """
    device = scaled.device
    vocab = scaled.shape[-1]
    top_k = table[:, _TOP_K].long()
    top_p = table[:, _TOP_P]
    wants_nucleus = any(p.top_p < 1.0 for p in params)
    # The log of each row's total mass once top-k has cut it: over the top k alone where k is set, else all.
    log_total_all = scaled.logsumexp(dim=-1, keepdim=True) if wants_nucleus else None
    looked_at = min(vocab, max(_tokens_to_look_at(p) for p in params))
    # A row without a top k could need more tokens than guessed, which only a read of the device tells: a CPU
    # reads it for free, an accelerator looks at the whole vocabulary at once instead.
    if wants_nucleus and device.type != "cpu" and any(p.top_k == 0 for p in params):
        looked_at = vocab
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
        if looked_at == vocab or all(0 < p.top_k <= looked_at for p in params):
            break
        if bool((has_k.squeeze(1) | (mass[:, -1] >= top_p)).all()):  # a CPU alone gets here
            break
        looked_at = min(vocab, _WIDE_NUCLEUS_GUESS) if looked_at < _WIDE_NUCLEUS_GUESS else vocab
    kept = best.isfinite()
    cutoff = best.masked_fill(~kept, float("inf")).min(dim=-1, keepdim=True).values  # the last kept logit
    filtered = table[:, _FILTERED, None] > 0
    cutoff = cutoff.masked_fill(~filtered, float("-inf"))  # a row that asked for nothing keeps all
    return scaled.masked_fill(scaled < cutoff, float("-inf"))


def _tokens_to_look_at(params) -> int:
    """How many of a row's best tokens decide its filters: its top k (which also normalises its nucleus), or
    else a first guess at its nucleus; 0 when it asks for neither."""
    if params.top_k > 0:
        return params.top_k
    return _FIRST_NUCLEUS_GUESS if params.top_p < 1.0 else 0


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative (unnormalised) mass passes uniform * total mass.

    One random number per row rather than one per vocabulary entry (the exponential race): on a 2-core CPU,
    drawing 32,000 exponentials a row took a sixth of a batch-32 decode step. A token of zero mass adds
    nothing to the cumulative sum, so no draw can land on it.
    """
    cumulative = probs.cumsum(dim=-1)
    tokens = torch.searchsorted(cumulative, uniforms * cumulative[:, -1:], right=True).squeeze(1)
    past_end = tokens >= probs.shape[-1]  # uniform * total rounded up to the total itself: rare, but possible
    # Reading the flag back is free on a CPU (and spares an argmax); elsewhere the fallback is always computed.
    if probs.device.type != "cpu" or bool(past_end.any()):
        tokens = torch.where(past_end, probs.argmax(dim=-1), tokens)
    return tokens


def _logprob_table(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]) -> torch.Tensor:
    """Per row [token, its logprob, top ids..., top logprobs...] in float64, which holds every id and every float32
    exactly: the logprobs of the raw model distribution, before temperature and filtering (as vLLM's)."""
    logprobs = logits.log_softmax(dim=-1)
    columns = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double()]
    max_top = max(n or 0 for n in wanted)
    if max_top:
        top_values, top_ids = logprobs.topk(max_top, dim=-1)
        columns += [top_ids.double(), top_values.double()]
    return torch.cat(columns, dim=1)


def _unpack_logprobs(host: list[list[float]], wanted: list[int | None]) -> tuple[list[int], list[TokenLogprob | None]]:
    max_top = max(n or 0 for n in wanted)
    results: list[TokenLogprob | None] = []
    for row, n in zip(host, wanted, strict=True):
        if n is None:
            results.append(None)
            continue
        ids, values = row[2 : 2 + n], row[2 + max_top : 2 + max_top + n]
        results.append(TokenLogprob(int(row[0]), row[1], [(int(i), v) for i, v in zip(ids, values, strict=True)]))
    return [int(row[0]) for row in host], results
