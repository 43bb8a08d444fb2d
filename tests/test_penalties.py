"""Logit bias and the repetition, frequency and presence penalties: bit-exact against a per-token reference of
vLLM's definitions in a mixed batch, and greedy outputs equal to transformers' generate."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
import torch
from conftest import random_prompts

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.penalties import apply_logit_adjustments
from gpu_runtime.sampler import Sampler
from gpu_runtime.sequence import Sequence

VOCAB = 500
NUM_TOKENS = 32


def reference_adjust(row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """One row, token by token, in float32: logit bias, then repetition (prompt and output), then frequency and
    presence (output only), as vLLM's sampler orders and defines them."""
    row = row.clone()
    for token, bias in params.logit_bias:
        row[token] = row[token] + torch.tensor(bias, dtype=torch.float32)
    penalty = torch.tensor(params.repetition_penalty, dtype=torch.float32)
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            row[token] = row[token] / penalty if row[token] > 0 else row[token] * penalty
    frequency = torch.tensor(params.frequency_penalty, dtype=torch.float32)
    presence = torch.tensor(params.presence_penalty, dtype=torch.float32)
    for token, count in Counter(output).items():
        row[token] = row[token] - frequency * count
        row[token] = row[token] - presence
    return row


class ReferenceProcessor:
    """reference_adjust as a transformers logits processor (one prompt at a time), for generate()."""

    def __init__(self, prompt_len: int, params: SamplingParams):
        self.prompt_len = prompt_len
        self.params = params

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        ids = input_ids[0].tolist()
        prompt, output = ids[: self.prompt_len], ids[self.prompt_len :]
        return reference_adjust(scores[0], prompt, output, self.params)[None, :]


def mixed_settings(vocab: int) -> list[SamplingParams]:
    """16 rows: some without any control, each control alone (both signs where it has them), and combinations."""
    rng = random.Random(7)

    def bias(n: int, low: float, high: float) -> dict[int, float]:
        return {token: rng.uniform(low, high) for token in rng.sample(range(vocab), n)}

    settings = [
        {},
        {"repetition_penalty": 1.3},
        {"repetition_penalty": 0.7},  # below 1 it encourages repeats
        {"presence_penalty": 1.5},
        {"presence_penalty": -1.0},
        {},
        {"frequency_penalty": 0.8},
        {"frequency_penalty": -2.0},
        {"logit_bias": bias(20, -5, 5)},
        {"logit_bias": {rng.randrange(vocab): 100.0}},
        {"repetition_penalty": 1.5, "frequency_penalty": 0.5},
        {"presence_penalty": 2.0, "frequency_penalty": 2.0},
        {"logit_bias": bias(5, -100, 100), "repetition_penalty": 2.0, "presence_penalty": 0.3},
        {
            "logit_bias": bias(min(300, vocab - 8), -3, 3),
            "frequency_penalty": 0.4,
            "presence_penalty": -0.5,
            "repetition_penalty": 1.1,
        },
        {},
        {"repetition_penalty": 1.2, "presence_penalty": 0.5},
    ]
    return [SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, **s) for s in settings]


def sequences(settings: list[SamplingParams], vocab: int, seed: int = 0) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for index, params in enumerate(settings):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        seq = Sequence(f"r{index}", prompt, params, max_model_len=1 << 20, eos_token_ids=frozenset())
        # Repeats in the output, so that frequency counts above 1 occur.
        seq.output_token_ids = [rng.randrange(vocab // 10) for _ in range(rng.randint(0, 40))]
        seqs.append(seq)
    return seqs


def reference_batch(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return torch.stack(
        [
            reference_adjust(row, s.prompt_token_ids, s.output_token_ids, s.params)
            for row, s in zip(logits, seqs, strict=True)
        ]
    )


def test_logit_bias_is_kept_sorted_hashable_and_crosses_the_wire_checked():
    params = SamplingParams(logit_bias={9: 1, 2: -100.0}, presence_penalty=0.5)
    assert params.logit_bias == ((2, -100.0), (9, 1.0))
    assert params == SamplingParams(logit_bias=[(9, 1.0), (2, -100)], presence_penalty=0.5)
    hash(params)  # still shareable across prompts
    wire = msgspec.msgpack.encode(params)
    assert msgspec.msgpack.decode(wire, type=SamplingParams) == params
    forged = msgspec.msgpack.encode({"logit_bias": [[1, 500.0]]})
    with pytest.raises(msgspec.ValidationError, match="logit_bias: the bias of token 1 must be in"):
        msgspec.msgpack.decode(forged, type=SamplingParams)


# -- the batched adjustments against the reference, bit for bit ---------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_mixed_batch_of_16_equals_the_reference_bit_for_bit(seed):
    seqs = sequences(mixed_settings(VOCAB), VOCAB, seed)
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    expected = reference_batch(logits, seqs)
    adjusted = apply_logit_adjustments(logits, seqs, in_place=False)
    assert torch.equal(adjusted, expected)
    # Rows without any control are untouched, and so are the caller's logits.
    untouched = [row for row, seq in enumerate(seqs) if not seq.params.adjusts_logits]
    assert len(untouched) == 3
    assert torch.equal(adjusted[untouched], logits[untouched])
    assert not torch.equal(adjusted, logits)


def test_a_batch_where_every_row_asks_equals_the_reference_in_place():
    seqs = [s for s in sequences(mixed_settings(VOCAB), VOCAB, seed=3) if s.params.adjusts_logits]
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    expected = reference_batch(logits, seqs)
    assert apply_logit_adjustments(logits, seqs, in_place=True) is logits
    assert torch.equal(logits, expected)


def test_without_any_control_the_logits_are_returned_as_they_are():
    seqs = sequences([SamplingParams(temperature=0)] * 4, VOCAB)
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    assert apply_logit_adjustments(logits, seqs, in_place=True) is logits
    assert torch.equal(logits, before)


def test_repetition_counts_the_prompt_and_presence_and_frequency_do_not():
    # Token 3 is the best by far, and it is in the prompt only.
    logits = torch.full((1, 8), 1.0)
    logits[0, 3] = 4.0

    def pick(**controls) -> int:
        seq = Sequence("r", [3, 3, 3], SamplingParams(temperature=0, **controls), 64, frozenset())
        return Sampler()(logits.clone(), [seq])[0][0]

    assert pick() == 3
    assert pick(presence_penalty=2.0, frequency_penalty=2.0) == 3  # a prompt token is not penalised by these
    assert pick(repetition_penalty=5.0) != 3  # 4 / 5 falls below the others' 1.0


def test_frequency_penalises_per_occurrence_and_presence_once():
    logits = torch.zeros(1, 4)
    logits[0, 1] = 3.0
    seq = Sequence("r", [0], SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), 64, frozenset())
    seq.output_token_ids = [1, 1, 1, 2]
    adjusted = apply_logit_adjustments(logits, [seq], in_place=False)
    assert adjusted[0].tolist() == [0.0, 3.0 - 1.5 - 1.0, -0.5 - 1.0, 0.0]


def test_logprobs_stay_those_of_the_raw_model_as_vllm_returns_them():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    forced = int(logits[0].argmin())
    params = SamplingParams(temperature=0, logprobs=1, logit_bias={forced: 100.0})
    seqs = sequences([params, SamplingParams(temperature=0, logprobs=1)], VOCAB)
    before = logits.clone()
    tokens, logprobs = Sampler()(logits, seqs)
    assert tokens[0] == forced
    raw = before.log_softmax(dim=-1)
    assert logprobs[0].logprob == pytest.approx(float(raw[0, forced]))
    assert logprobs[0].top[0][0] == int(before[0].argmax())
    assert torch.equal(logits, before)  # the caller's logits were not adjusted in place


def test_sampled_rows_draw_from_the_adjusted_distribution():
    """A seeded sampled row with controls picks what the same seed picks from the reference-adjusted logits."""
    settings = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, **controls)
        for controls in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.0, "logit_bias": {7: 3.0}}, {})
    ]
    for step in range(20):
        logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(step))
        seqs = sequences(settings, VOCAB, seed=step)
        expected_logits = reference_batch(logits, seqs)
        plain = [SamplingParams(temperature=0.8, top_p=0.9, seed=11)] * 3
        tokens, _ = Sampler()(logits, _reseeded(seqs, settings))
        expected, _ = Sampler()(expected_logits, _reseeded(sequences(plain, VOCAB, seed=step), plain))
        assert tokens == expected


def _reseeded(seqs: list[Sequence], settings: list[SamplingParams]) -> list[Sequence]:
    for seq, params in zip(seqs, settings, strict=True):
        seq.generator = torch.Generator().manual_seed(params.seed)
    return seqs


# -- the engine against transformers --------------------------------------------------------------------------


def transformers_generate(model_dir, prompts: list[list[int]], settings: list[SamplingParams]) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time: its own repetition_penalty where that is the only
    control, else the reference processor (which orders the controls as vLLM does)."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly NUM_TOKENS, as ignore_eos
    outputs = []
    with torch.inference_mode():
        for prompt, params in zip(prompts, settings, strict=True):
            ids = torch.tensor([prompt])
            options = {}
            only_repetition = not (params.logit_bias or params.presence_penalty or params.frequency_penalty)
            if only_repetition:
                options["repetition_penalty"] = params.repetition_penalty
            else:
                options["logits_processor"] = LogitsProcessorList([ReferenceProcessor(len(prompt), params)])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_TOKENS, do_sample=False, **options
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def penalty_case(llama_dir):
    from checkpoints import VOCAB_SIZE

    prompts = random_prompts(16, 1, 120, seed=4)
    settings = mixed_settings(VOCAB_SIZE)
    return llama_dir, prompts, settings, transformers_generate(llama_dir, prompts, settings)


def test_a_mixed_batch_of_16_equals_transformers_generate(penalty_case):
    model_dir, prompts, settings, expected = penalty_case
    # 6 slots for 16 requests: rows with and without controls join and leave the batch at different steps.
    llm = LLM(str(model_dir), max_num_seqs=6)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], settings)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # The controls changed what greedy decoding would have said, so the comparison is not vacuous.
    plain = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
    )
    changed = [o.outputs[0].token_ids != p.outputs[0].token_ids for o, p in zip(outputs, plain, strict=True)]
    controlled = [s.adjusts_logits for s in settings]
    assert not any(c for c, has in zip(changed, controlled, strict=True) if not has)
    assert sum(changed) >= 10, changed


def test_repetition_penalty_alone_equals_transformers_own(penalty_case):
    model_dir, prompts, _, _ = penalty_case
    penalties = [1.0, 1.1, 1.3, 2.0, 0.8, 1.05, 1.5, 3.0]
    settings = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, repetition_penalty=p) for p in penalties
    ]
    expected = transformers_generate(model_dir, prompts[:8], settings)
    outputs = LLM(str(model_dir)).generate([{"prompt_token_ids": p} for p in prompts[:8]], settings)
    assert [o.outputs[0].token_ids for o in outputs] == expected
