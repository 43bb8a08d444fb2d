"""The Sampler on hand-built logits: greedy, top-k/top-p/min-p filtering, frequencies, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.sampler import Sampler
from gpu_runtime.sequence import Sequence

VOCAB = 32


def seq(params: SamplingParams, seed: int | None = None, name: str = "r") -> Sequence:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return Sequence(name, [1], params, max_model_len=1 << 20, eos_token_ids=frozenset(), generator=generator)


def logits_with_max_at(positions: list[int], vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Random logits, one row per position, whose argmax is that position (by a margin of about 1)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(positions), vocab, generator=g)
    for row, pos in enumerate(positions):
        logits[row, pos] = logits[row].max() + 1.0
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]):
    return Sampler()(logits, seqs)


def empirical(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double() / len(tokens)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Samples one distribution n times (as one batch of n identical rows); returns the frequencies."""
    torch.manual_seed(seed)
    logits = logits_row.expand(n, -1).contiguous()
    tokens, _ = sample(logits, [seq(params)] * n)
    return empirical(tokens, logits.shape[-1])


# -- deterministic choices ------------------------------------------------------------------------


def test_greedy_picks_argmax_per_row():
    positions = [3, 0, 31, 17]
    tokens, logprobs = sample(logits_with_max_at(positions), [seq(SamplingParams(temperature=0))] * 4)
    assert tokens == positions
    assert logprobs == [None] * 4


def test_greedy_rows_stay_greedy_in_a_batch_that_samples():
    positions = [5, 9, 12, 20]
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0), SamplingParams(temperature=0)] * 100
    logits = logits_with_max_at(positions * 75, seed=1)
    torch.manual_seed(0)
    tokens, _ = sample(logits, [seq(p) for p in params])
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    assert [tokens[i] for i in greedy_rows] == [(positions * 75)[i] for i in greedy_rows]
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    # A sampling row at temperature 2 over 32 tokens does not always land on the argmax.
    assert any(tokens[i] != (positions * 75)[i] for i in sampled_rows)


@pytest.mark.parametrize("temperature", [1.0, 10.0, 1000.0])
def test_top_k_1_always_picks_argmax(temperature):
    positions = [i % VOCAB for i in range(0, 400, 7)]
    logits = logits_with_max_at(positions, seed=2)
    torch.manual_seed(0)
    tokens, _ = sample(logits, [seq(SamplingParams(temperature=temperature, top_k=1))] * len(positions))
    assert tokens == positions


def test_tiny_top_p_keeps_only_the_top_token():
    positions = [i % VOCAB for i in range(0, 500, 3)]
    logits = logits_with_max_at(positions, seed=3)
    torch.manual_seed(0)
    tokens, _ = sample(logits, [seq(SamplingParams(temperature=5.0, top_p=1e-6))] * len(positions))
    assert tokens == positions


def test_min_p_1_keeps_only_the_max():
    positions = [i % VOCAB for i in range(0, 500, 5)]
    logits = logits_with_max_at(positions, seed=4)
    torch.manual_seed(0)
    tokens, _ = sample(logits, [seq(SamplingParams(temperature=5.0, min_p=1.0))] * len(positions))
    assert tokens == positions


def test_filters_never_pick_a_filtered_token():
    """top_k=3 at high temperature draws only from the 3 most likely tokens, all three of them."""
    row = torch.linspace(0, 3, VOCAB)  # token 31 most likely, then 30, 29
    freqs = draw_many(row, SamplingParams(temperature=100.0, top_k=3), n=3000)
    assert set(torch.nonzero(freqs).flatten().tolist()) == {29, 30, 31}


def _reference_support(logits_row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The tokens top-k then top-p keep, by the textbook method: a full sort in float64."""
    ordered, order = logits_row.double().sort(descending=True)
    if top_k:
        ordered, order = ordered[:top_k], order[:top_k]
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    return set(order[mass_before < top_p].tolist())


@pytest.mark.parametrize(
    ("top_k", "top_p"),
    [(0, 0.3), (0, 0.9), (100, 0.5), (120, 1.0), (5, 0.9)],
    ids=[
        "nucleus-inside-the-first-64",
        "nucleus-past-the-first-64",
        "top-k-normalises-the-nucleus",
        "top-k-only",
        "small-top-k",
    ],
)
def test_filters_keep_exactly_the_textbook_support(top_k, top_p):
    """On a near-flat distribution over 300 tokens (nuclei of 34 and 194 tokens; the sampler looks at the best 64
    first), every kept token is drawn and no other."""
    shuffled = torch.randperm(300, generator=torch.Generator().manual_seed(0))
    logits = -0.01 * shuffled.float()  # all different, none far from the others
    expected = _reference_support(logits, top_k, top_p)
    freqs = draw_many(logits, SamplingParams(top_k=top_k, top_p=top_p), n=60_000)
    assert set(torch.nonzero(freqs).flatten().tolist()) == expected


def test_a_row_without_filters_keeps_every_token_beside_filtered_rows():
    seqs = [seq(SamplingParams(top_k=2)), seq(SamplingParams(top_p=0.1)), seq(SamplingParams())] * 1000
    logits = torch.linspace(0, 1, VOCAB).expand(len(seqs), -1).contiguous()  # token 31 most likely, then 30
    torch.manual_seed(0)
    tokens, _ = sample(logits, seqs)
    assert set(tokens[0::3]) == {30, 31}
    assert set(tokens[1::3]) == {29, 30, 31}  # 0.1 of the mass needs three tokens here
    assert len(set(tokens[2::3])) == VOCAB


# -- frequencies ----------------------------------------------------------------------------------

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], dtype=torch.float64)
N = 20_000
TOL = 0.015  # > 4.5 standard deviations of a frequency near 0.5 over 20,000 draws


def assert_close(freqs: torch.Tensor, expected: torch.Tensor) -> None:
    gap = (freqs - expected).abs().max().item()
    assert gap < TOL, f"frequencies {freqs.tolist()} vs expected {expected.tolist()}"


def test_temperature_1_frequencies_follow_softmax():
    logits = PROBS.log().float() + 3.0  # a shift changes nothing
    assert_close(draw_many(logits, SamplingParams(temperature=1.0), N), PROBS)


def test_temperature_2_frequencies_follow_softmax_of_halved_logits():
    logits = PROBS.log().float()
    expected = (PROBS.log() / 2).softmax(-1)
    assert_close(draw_many(logits, SamplingParams(temperature=2.0), N, seed=1), expected)


def test_top_k_frequencies_are_the_renormalised_top_k():
    logits = PROBS.log().float()
    expected = torch.zeros_like(PROBS)
    expected[:2] = PROBS[:2] / PROBS[:2].sum()
    assert_close(draw_many(logits, SamplingParams(top_k=2), N, seed=2), expected)


def test_top_p_keeps_the_smallest_set_reaching_top_p():
    # Mass before each token: 0, 0.4, 0.65, 0.8, ... so top_p=0.7 keeps the first three (0.8 > 0.7).
    logits = PROBS.log().float()
    expected = torch.zeros_like(PROBS)
    expected[:3] = PROBS[:3] / PROBS[:3].sum()
    assert_close(draw_many(logits, SamplingParams(top_p=0.7), N, seed=3), expected)


def test_min_p_drops_tokens_below_a_fraction_of_the_max():
    # 0.2 * 0.4 = 0.08: tokens 4 and 5 (0.06, 0.04) go, token 3 (0.1) stays.
    logits = PROBS.log().float()
    expected = torch.zeros_like(PROBS)
    expected[:4] = PROBS[:4] / PROBS[:4].sum()
    assert_close(draw_many(logits, SamplingParams(min_p=0.2), N, seed=4), expected)


def test_unseeded_draws_vary():
    logits = torch.zeros(1, VOCAB)
    tokens = []
    for _ in range(20):
        tokens += sample(logits, [seq(SamplingParams())])[0]
    assert len(set(tokens)) > 5


# -- seeds ----------------------------------------------------------------------------------------


def _seeded_run(seed: int, row: int, mates: list[SamplingParams], steps: int = 30) -> list[int]:
    """Draws `steps` tokens for one seeded request placed at `row` among batch-mates."""
    target = seq(SamplingParams(temperature=1.0, seed=seed), seed=seed, name="target")
    others = [seq(p, seed=p.seed, name=f"mate{i}") for i, p in enumerate(mates)]
    batch = others[:row] + [target] + others[row:]
    logits = torch.zeros(len(batch), VOCAB)  # uniform: every draw is decided by the noise alone
    logits[:, :4] += 0.5
    out = []
    for _ in range(steps):
        tokens, _ = sample(logits, batch)
        out.append(tokens[row])
    return out


def test_seeded_request_gets_the_same_tokens_whatever_shares_its_batch():
    alone = _seeded_run(1234, 0, [])
    assert len(set(alone)) > 5, "the seeded draws should not be constant"
    torch.manual_seed(99)
    assert _seeded_run(1234, 0, []) == alone
    mates = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, seed=7),
    ]
    torch.manual_seed(5)
    assert _seeded_run(1234, 2, mates) == alone
    torch.manual_seed(6)
    assert _seeded_run(1234, 4, mates) == alone
    assert _seeded_run(1234, 1, mates[:2]) == alone


def test_different_seeds_give_different_tokens():
    assert _seeded_run(1, 0, []) != _seeded_run(2, 0, [])


def test_seeded_row_ignores_global_rng():
    torch.manual_seed(0)
    first = _seeded_run(42, 0, [SamplingParams()])
    torch.manual_seed(12345)
    assert _seeded_run(42, 0, [SamplingParams()]) == first


# -- logprobs ------------------------------------------------------------------------------------


def test_logprobs_2_returns_raw_logprob_and_top_2():
    logits = torch.tensor([[1.0, 3.0, 2.5, -1.0, 0.0]])
    raw = logits.log_softmax(-1)[0]
    torch.manual_seed(0)
    for temperature, top_k in [(0.0, 0), (0.3, 0), (5.0, 3)]:
        params = SamplingParams(temperature=temperature, top_k=top_k, logprobs=2)
        tokens, logprobs = sample(logits, [seq(params)])
        (lp,) = logprobs
        assert lp.token_id == tokens[0]
        # The raw model distribution: no temperature, no filtering applied to the reported value.
        assert lp.logprob == pytest.approx(raw[tokens[0]].item(), abs=1e-6)
        top = dict(lp.top)
        assert [token for token, _ in lp.top] == [1, 2], "top-2 ids, most likely first"
        assert top[1] == pytest.approx(raw[1].item(), abs=1e-6)
        assert top[2] == pytest.approx(raw[2].item(), abs=1e-6)
        assert math.exp(top[1]) + math.exp(top[2]) < 1


def test_logprobs_for_a_sampled_token_outside_the_top_n():
    """A drawn token that is not among the top 2 still gets its own logprob; the top list stays top-2."""
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 1] = 0.2, 0.1
    raw = logits.log_softmax(-1)[0]
    torch.manual_seed(0)
    seen_outside = False
    for _ in range(20):
        tokens, (lp,) = sample(logits, [seq(SamplingParams(logprobs=2))])
        assert lp.logprob == pytest.approx(raw[tokens[0]].item(), abs=1e-6)
        assert [token for token, _ in lp.top] == [0, 1]
        seen_outside |= tokens[0] not in dict(lp.top)
    assert seen_outside


def test_logprobs_per_row_none_zero_and_n():
    logits = logits_with_max_at([4, 7, 9], seed=5)
    raw = logits.log_softmax(-1)
    seqs = [
        seq(SamplingParams(temperature=0)),
        seq(SamplingParams(temperature=0, logprobs=0)),
        seq(SamplingParams(temperature=0, logprobs=3)),
    ]
    tokens, logprobs = sample(logits, seqs)
    assert tokens == [4, 7, 9]
    assert logprobs[0] is None
    assert logprobs[1].token_id == 7 and logprobs[1].top == []
    assert logprobs[1].logprob == pytest.approx(raw[1, 7].item(), abs=1e-6)
    top_values, top_ids = raw[2].topk(3)
    assert [token for token, _ in logprobs[2].top] == top_ids.tolist()
    assert [value for _, value in logprobs[2].top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert logprobs[2].logprob == pytest.approx(raw[2, 9].item(), abs=1e-6)


@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_tiny_positive_temperature_picks_the_argmax(temperature):
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    torch.manual_seed(0)
    tokens, _ = sample(logits, [seq(SamplingParams(temperature=temperature))])
    assert tokens == [2]


# -- devices --------------------------------------------------------------------------------------


def test_seeded_draws_come_from_a_cpu_generator_whatever_the_logits_device():
    """The CPU generator path: a seeded row's uniform is its own CPU generator's next draw, on every device, so a
    seed gives the same tokens on CPU and GPU. Uniform logits over 8 tokens map a uniform u to token floor(8u)."""
    vocab, steps = 8, 40
    reference = torch.Generator().manual_seed(77)
    expected = [int(torch.rand(1, generator=reference).item() * vocab) for _ in range(steps)]
    seeded = seq(SamplingParams(temperature=1.0, seed=77), seed=77)
    torch.manual_seed(0)
    got = [sample(torch.zeros(1, vocab), [seeded])[0][0] for _ in range(steps)]
    assert got == expected
    # On another device (meta: no data, so any read of it would fail) the draw is still the CPU generator's.
    meta_seeded = seq(SamplingParams(temperature=1.0, seed=77), seed=77)
    tokens = Sampler().on_device(torch.zeros(1, vocab, device="meta"), [meta_seeded])
    assert tokens.device.type == "meta"
    assert meta_seeded.generator.device.type == "cpu"
    reference = torch.Generator().manual_seed(77)
    torch.rand(1, generator=reference)  # the draw the meta step took
    assert torch.rand(1, generator=meta_seeded.generator) == torch.rand(1, generator=reference)


def test_same_seed_same_tokens_in_two_different_batches_on_any_row():
    """A seeded top-p row samples the same tokens as row 0 of one batch and row 3 of another, beside greedy,
    filtered and other seeded rows."""
    vocab = 300
    logits_row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=5)

    def run(mates: list[SamplingParams], row: int) -> list[int]:
        target = seq(params, seed=5, name="target")
        others = [seq(p, seed=p.seed, name=f"m{i}") for i, p in enumerate(mates)]
        batch = others[:row] + [target] + others[row:]
        logits = logits_row.expand(len(batch), -1).contiguous()
        return [sample(logits.clone(), batch)[0][row] for _ in range(25)]

    alone = run([], 0)
    assert len(set(alone)) > 3
    mates = [SamplingParams(temperature=0), SamplingParams(top_k=3, seed=9), SamplingParams(min_p=0.2, logprobs=2)]
    torch.manual_seed(1)
    assert run(mates, 3) == alone
    torch.manual_seed(2)
    assert run(mates[:2], 1) == alone


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(temperature=0)],
        [SamplingParams(temperature=0.8, top_p=0.9, seed=3)],  # a nucleus with no top k: the whole vocabulary
        [SamplingParams(temperature=1.0, top_k=5, top_p=0.5), SamplingParams(temperature=0)],
        [SamplingParams(temperature=0.7, min_p=0.1), SamplingParams(temperature=0, logprobs=3)],
        [SamplingParams(temperature=1.2, logprobs=0), SamplingParams(temperature=0.9, top_p=0.95, top_k=40)],
    ],
    ids=["greedy", "top-p-seeded", "top-k-top-p-beside-greedy", "min-p-beside-logprobs", "logprobs-0-and-filters"],
)
def test_sampling_never_reads_the_device(params):
    """Every branch is decided from the parameters on the host: the whole step runs on the meta device, where any
    read of a value (a `bool(tensor)`, a `.item()`) raises, and returns one tensor for the step's single read."""
    seqs = [seq(p, seed=p.seed, name=f"r{i}") for i, p in enumerate(params)]
    out = Sampler().on_device(torch.randn(len(seqs), 1000, device="meta"), seqs)
    assert out.device.type == "meta"
    max_top = max((p.logprobs or 0) for p in params)
    wants_logprobs = any(p.logprobs is not None for p in params)
    assert tuple(out.shape) == ((len(seqs), 2 + 2 * max_top) if wants_logprobs else (len(seqs),))


def test_engine_gives_a_seeded_request_a_cpu_generator(llama_dir):
    from gpu_runtime.engine import LLMEngine
    from gpu_runtime.engine_config import EngineConfig

    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", kv_cache_bytes=16 << 20))
    engine.add_request("seeded", [1, 2, 3], SamplingParams(max_tokens=2, seed=11))
    engine.add_request("unseeded", [1, 2, 3], SamplingParams(max_tokens=2))
    generators = {s.request_id: s.generator for s in engine.scheduler.waiting}
    assert generators["seeded"].device == torch.device("cpu")
    assert generators["seeded"].initial_seed() == 11
    assert generators["unseeded"] is None
