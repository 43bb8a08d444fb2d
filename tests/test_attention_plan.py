"""The attention backend interface: a per-step plan (once per step, before the forward, the masks built there by
the backends that use them), then per-layer forwards with the layer's options, which the torch reference and the
batched backend honour (a sliding window, soft-capped logits, a scale) against attention computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.attention.backend import AttentionBackend, LayerAttentionOptions, make_attention_backend
from gpu_runtime.attention.metadata import PlanRow
from gpu_runtime.step_inputs import StepPlan, inputs_of_plan

CPU = torch.device("cpu")
PAGE_SIZE, NUM_PAGES, KV_HEADS, GROUP, DIM = 4, 12, 2, 2, 8


def _step(seed: int = 0):
    """Pages holding a 6-token cached prefix for sequence A (pages 0-2), and a step of: one decode of B (context 5,
    pages 3-4), then A's 4-token chunk (context 10). Returns (q, k, v, k_pages, v_pages, meta, contexts)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_PAGES, PAGE_SIZE, KV_HEADS, DIM)
    k_pages, v_pages = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    decode = PlanRow(query_start=0, query_len=1, context_len=5, pages=[3, 4])
    chunk = PlanRow(query_start=1, query_len=4, context_len=10, pages=[0, 1, 2])
    slots = [4 * PAGE_SIZE + 0] + list(range(6, 10))  # B's position 4 opens page 4; A's positions 6-9 are pages 1-2
    plan = StepPlan([1] * 5, [4, 6, 7, 8, 9], slots, [0, 4], [decode], [chunk], 1)
    meta = inputs_of_plan(plan, CPU).meta
    q = torch.randn(5, KV_HEADS * GROUP, DIM, generator=generator)
    k, v = torch.randn(5, KV_HEADS, DIM, generator=generator), torch.randn(5, KV_HEADS, DIM, generator=generator)
    return q, k, v, k_pages, v_pages, meta, [(decode, slice(0, 1)), (chunk, slice(1, 5))]


def _by_hand(q, k_pages, v_pages, row: PlanRow, options: LayerAttentionOptions) -> torch.Tensor:
    """Each query, head by head, over the keys its window lets it see: the textbook formula, in float64."""
    keys = k_pages[row.pages].flatten(0, 1)[: row.context_len].double()
    values = v_pages[row.pages].flatten(0, 1)[: row.context_len].double()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(row.query_len):
        position = row.context_len - row.query_len + i
        first = 0 if options.sliding_window is None else max(0, position - options.sliding_window + 1)
        for head in range(q.shape[1]):
            kv = head // GROUP
            scores = keys[first : position + 1, kv] @ q[i, head].double() * options.scale
            if options.logit_softcap is not None:
                scores = options.logit_softcap * torch.tanh(scores / options.logit_softcap)
            out[i, head] = scores.softmax(0) @ values[first : position + 1, kv]
    return out


@pytest.mark.fast
@pytest.mark.parametrize(
    "options",
    [
        LayerAttentionOptions(scale=1 / math.sqrt(DIM)),
        LayerAttentionOptions(scale=1 / math.sqrt(DIM), sliding_window=3),
        LayerAttentionOptions(scale=0.5, logit_softcap=2.0),
        LayerAttentionOptions(scale=0.3, sliding_window=2, logit_softcap=5.0),
    ],
    ids=["plain", "window", "softcap-scale", "all"],
)
@pytest.mark.parametrize("name", ["torch", "batched"])  # cpu_paged's kernel takes a build: test_model_families.py
def test_the_backends_honour_a_layers_options(options, name):
    q, k, v, k_pages, v_pages, meta, rows = _step()
    backend = make_attention_backend(name, CPU)
    backend.check_options(options)
    backend.plan(meta)
    out = backend.forward(q, k, v, k_pages, v_pages, meta, options)  # writes the new K/V into the pages first
    for row, rows_of in rows:
        expected = _by_hand(q[rows_of], k_pages, v_pages, row, options)
        torch.testing.assert_close(out[rows_of].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.fast
def test_the_batched_backend_planned_equals_the_reference():
    """(cpu_paged, whose kernel takes a build: test_attention_backends.py, against transformers.)"""
    backend = make_attention_backend("batched", CPU)
    options = LayerAttentionOptions.default(DIM)
    outputs = []
    for candidate in (backend, make_attention_backend("torch", CPU)):
        q, k, v, k_pages, v_pages, meta, _ = _step()
        candidate.plan(meta)
        outputs.append(candidate.forward(q, k, v, k_pages, v_pages, meta, options))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("name", ["batched", "torch"])
def test_a_forward_without_its_steps_plan_is_refused(name):
    q, k, v, k_pages, v_pages, meta, _ = _step()
    backend = make_attention_backend(name, CPU)
    with pytest.raises(RuntimeError, match="forward before plan"):
        backend.forward(q, k, v, k_pages, v_pages, meta, LayerAttentionOptions.default(DIM))
    backend.plan(_step(seed=1)[5])  # another step's metadata
    with pytest.raises(RuntimeError, match="forward before plan"):
        backend.forward(q, k, v, k_pages, v_pages, meta, LayerAttentionOptions.default(DIM))


class PlainOnly(AttentionBackend):
    """A backend that runs plain attention only: it keeps the interface's check_options."""

    name = "plain_only"

    def plan(self, meta):
        pass

    def forward(self, q, k, v, k_pages, v_pages, meta, options):
        raise NotImplementedError


@pytest.mark.fast
def test_options_a_backend_cannot_run_are_refused_as_the_model_is_built():
    backend = PlainOnly()
    backend.check_options(LayerAttentionOptions.default(DIM))
    with pytest.raises(ValueError, match="plain_only has no sliding-window attention"):
        backend.check_options(LayerAttentionOptions(scale=0.1, sliding_window=8))
    with pytest.raises(ValueError, match="plain_only has no logit soft-capping"):
        backend.check_options(LayerAttentionOptions(scale=0.1, logit_softcap=30.0))
    for name in ("torch", "batched"):  # (cpu_paged too: its kernel's layers are the plain ones, the rest batched)
        make_attention_backend(name, CPU).check_options(LayerAttentionOptions(0.1, sliding_window=8, logit_softcap=3))


@pytest.mark.fast
def test_default_scale_is_sdpas_own():
    """The model passes its scale explicitly: the double SDPA would compute itself, so no output changes."""
    for head_dim in (64, 96, 128, 192):
        assert LayerAttentionOptions.default(head_dim).scale == 1.0 / math.sqrt(head_dim)


@pytest.mark.engine
@pytest.mark.parametrize("name", ["torch", "batched"])
def test_the_runner_plans_once_per_step_before_the_forward(llama_dir, name):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", attention_backend=name, max_num_seqs=4))
    backend = engine.runner.model.attention_backend
    events = []
    plan, forward = backend.plan, backend.forward
    backend.plan = lambda meta: (events.append("plan"), plan(meta))[1]
    backend.forward = lambda *args: (events.append("forward"), forward(*args))[1]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7, 8, 9], params)
    engine.add_request("b", [10, 11], params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    layers = engine.model_config.num_layers
    assert events == (["plan"] + ["forward"] * layers) * steps
