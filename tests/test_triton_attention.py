"""The Triton backend's kernels equal the torch reference, run on this CPU under Triton's interpreter: split-KV
decode and varlen prefill over cached pages, page sizes 1 and 16, GQA groups 1, 4 and 8, odd lengths, prefix hits,
chunk boundaries, a window and a soft-cap; then the engine on the triton backend gives transformers' greedy tokens.

The interpreter runs each program in Python: the shapes are tiny, and the tile sizes shrunk to match, so that
they still meet several tiles, partitions and query blocks."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch

# Triton decides as it decorates a kernel whether it is compiled or interpreted: the kernels' module is imported
# here under the interpreter. The variable is then put back, and set again for each test of this file only (parts
# of triton.language read it as the kernels run), so that no process another test starts inherits it.
_interpret = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton", reason="triton is not installed (pip install triton --no-deps)")
    from gpu_runtime.attention import triton_kernels  # noqa: F401
finally:
    if _interpret is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _interpret

from checkpoints import GEMMA2, LLAMA_GQA, write_checkpoint  # noqa: E402
from conftest import transformers_greedy  # noqa: E402

from gpu_runtime import LLM, SamplingParams  # noqa: E402
from gpu_runtime.attention.backend import LayerAttentionOptions, make_attention_backend  # noqa: E402
from gpu_runtime.attention.decode_graph_buckets import pad_decode_plan  # noqa: E402
from gpu_runtime.attention.metadata import PlanRow  # noqa: E402
from gpu_runtime.attention.triton_paged import TritonPagedAttention  # noqa: E402
from gpu_runtime.attention.triton_plan import TritonTuning, decode_partition_size, prefill_programs  # noqa: E402
from gpu_runtime.step_inputs import StepPlan, inputs_of_plan  # noqa: E402

pytestmark = pytest.mark.engine


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


CPU = torch.device("cpu")
HEAD_DIM, KV_HEADS = 16, 2
MAX_ABS_ERROR = 2e-3
# Small tiles and partitions: a 40-token context is then 3 decode partitions of 16, and a 20-token chunk 2-3 query
# blocks, exercising the combine and the block boundaries at interpreter cost. (Tiles under 16 run only under the
# interpreter: a GPU's tl.dot needs 16 a side, which the default tuning has.)
TINY = TritonTuning(decode_block_n=8, prefill_block_m=16, prefill_block_n=16, min_partition=16, num_sms=16)


@dataclass(frozen=True)
class Sequence:
    cached: int  # tokens already in its pages before the step
    new: int  # tokens it computes this step
    decode: bool = False  # a single-query decode row (else a prompt chunk, even of one token)


def build_step(sequences: list[Sequence], page_size: int, group: int, seed: int = 0, graph_bucket: int | None = None):
    """(q, k, v, k_pages, v_pages, meta) of one step: the decodes first, then the chunks, as the runner orders them;
    each sequence's pages scattered through the pool in a random order, the pool random everywhere else. With a
    `graph_bucket`, a decode-only step is padded to it as a CUDA graph would replay it (page 0 the null page)."""
    rng = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    ordered = [s for s in sequences if s.decode] + [s for s in sequences if not s.decode]
    pages_needed = [-(-(s.cached + s.new) // page_size) for s in ordered]
    page_ids = list(range(1, sum(pages_needed) + 3))  # page 0 is the block tables' padding, never a real page
    rng.shuffle(page_ids)
    num_pages = len(page_ids) + 1
    rows: list[PlanRow] = []
    slots: list[int] = []
    num_tokens = 0
    for seq, needed in zip(ordered, pages_needed, strict=True):
        pages, page_ids = page_ids[:needed], page_ids[needed:]
        context = seq.cached + seq.new
        rows.append(PlanRow(num_tokens, seq.new, context, pages))
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(seq.cached, context)]
        num_tokens += seq.new
    decode_rows = [row for row, seq in zip(rows, ordered, strict=True) if seq.decode]
    prefill_rows = [row for row, seq in zip(rows, ordered, strict=True) if not seq.decode]
    plan = StepPlan([0] * num_tokens, [0] * num_tokens, slots, [], decode_rows, prefill_rows, len(decode_rows))
    if graph_bucket is not None:
        plan = pad_decode_plan(plan, graph_bucket, null_page=0, page_size=page_size)
    meta = inputs_of_plan(plan, CPU).meta
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM)
    k_pages, v_pages = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    q = torch.randn(num_tokens, KV_HEADS * group, HEAD_DIM, generator=generator)
    k = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    v = torch.randn(num_tokens, KV_HEADS, HEAD_DIM, generator=generator)
    if graph_bucket is not None:  # the padding rows' own (random) tokens, after the real ones'
        num_padding = graph_bucket - num_tokens
        q = torch.cat([q, torch.randn(num_padding, *q.shape[1:], generator=generator)])
        k = torch.cat([k, torch.randn(num_padding, *k.shape[1:], generator=generator)])
        v = torch.cat([v, torch.randn(num_padding, *v.shape[1:], generator=generator)])
    return q, k, v, k_pages, v_pages, meta


def max_error_against_reference(sequences, page_size, group, options=None, dtype=torch.float32) -> float:
    """Max abs difference of the triton backend's output from the torch reference's, on the same step."""
    options = options or LayerAttentionOptions.default(HEAD_DIM)
    outputs = []
    for backend in (TritonPagedAttention(CPU, TINY), make_attention_backend("torch", CPU)):
        q, k, v, k_pages, v_pages, meta = build_step(sequences, page_size, group)
        q, k, v, k_pages, v_pages = (x.to(dtype) for x in (q, k, v, k_pages, v_pages))
        backend.check_options(options)
        backend.plan(meta)
        outputs.append(backend.forward(q, k, v, k_pages, v_pages, meta, options).float())
    assert torch.isfinite(outputs[0]).all()
    return (outputs[0] - outputs[1]).abs().max().item()


# One step of each kind a scheduler makes, with odd lengths everywhere: decodes only (contexts short and long, one
# partition and several), fresh prompts only, prompt chunks after cached pages (prefix hits, and a chunk that
# starts mid-page), and all of them together.
DECODES = [Sequence(0, 1, True), Sequence(6, 1, True), Sequence(39, 1, True), Sequence(16, 1, True)]
FRESH_PROMPTS = [Sequence(0, 1), Sequence(0, 19), Sequence(0, 5)]
CACHED_CHUNKS = [Sequence(16, 17), Sequence(13, 3), Sequence(32, 1)]
MIXED = [Sequence(23, 1, True), Sequence(0, 9), Sequence(16, 1, True), Sequence(7, 18)]
STEPS = {"decodes": DECODES, "fresh-prompts": FRESH_PROMPTS, "cached-chunks": CACHED_CHUNKS, "mixed": MIXED}


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("step", STEPS, ids=str)
def test_kernels_equal_the_reference(step, page_size, group):
    assert max_error_against_reference(STEPS[step], page_size, group) <= MAX_ABS_ERROR


OPTIONS = {
    "window": LayerAttentionOptions(scale=HEAD_DIM**-0.5, sliding_window=7),
    "soft-cap": LayerAttentionOptions(scale=0.4, logit_softcap=2.0),
    "window-soft-cap": LayerAttentionOptions(scale=0.3, sliding_window=12, logit_softcap=5.0),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", OPTIONS, ids=str)
def test_a_layers_window_and_soft_cap_equal_the_reference(name, page_size):
    error = max_error_against_reference(MIXED + CACHED_CHUNKS, page_size, group=4, options=OPTIONS[name])
    assert error <= MAX_ABS_ERROR


@pytest.mark.parametrize("name", ["plain", "window-soft-cap"])
def test_half_precision_equals_the_reference(name):
    """A GPU's dtypes: the probabilities cast to the values' dtype for the second product, the output to the
    queries'. float16, as bfloat16's products are wrong in Triton 3.9's interpreter itself (its tl.dot multiplies
    the raw bits); the kernels compile for bfloat16: tests/test_triton_compile.py."""
    options = OPTIONS.get(name, LayerAttentionOptions.default(HEAD_DIM))
    error = max_error_against_reference(MIXED + CACHED_CHUNKS, 16, group=4, options=options, dtype=torch.float16)
    assert error <= 5e-3  # float16's own rounding, of outputs about 1 (the reference rounds differently)


def test_a_static_batchs_padding_rows_decode_where_they_lie():
    """Padding rows (a static batch's finished sequences) sit after the chunks: the decode rows are not one slice."""
    q, k, v, k_pages, v_pages, _ = build_step([Sequence(5, 1, True), Sequence(0, 4)], page_size=4, group=2)
    decode = PlanRow(0, 1, 6, [1, 2])
    chunk = PlanRow(1, 4, 4, [3])
    padding = PlanRow(5, 1, 3, [4])
    slots = [2 * 4 + 1, 12, 13, 14, 15]
    plan = StepPlan([0] * 6, [0] * 6, slots, [], [decode, padding], [chunk], num_real_decodes=1)
    meta = inputs_of_plan(plan, CPU).meta
    q = torch.cat([q, torch.randn(1, *q.shape[1:], generator=torch.Generator().manual_seed(1))])
    outputs = []
    for backend in (TritonPagedAttention(CPU, TINY), make_attention_backend("torch", CPU)):
        backend.plan(meta)
        outputs.append(backend.forward(q, k, v, k_pages.clone(), v_pages.clone(), meta,
                                       LayerAttentionOptions.default(HEAD_DIM)))  # fmt: skip
    assert (outputs[0] - outputs[1]).abs().max().item() <= MAX_ABS_ERROR


def test_a_decode_step_padded_to_its_graph_bucket_keeps_its_real_rows():
    """A decode-only step as a CUDA graph would replay it (its bucket's rows, the padding on the null page): the
    real rows' outputs are the unpadded step's."""
    outputs = []
    for bucket in (None, 8):
        q, k, v, k_pages, v_pages, meta = build_step(DECODES, page_size=16, group=4, graph_bucket=bucket)
        backend = TritonPagedAttention(CPU, TINY)
        backend.plan(meta)
        outputs.append(backend.forward(q, k, v, k_pages, v_pages, meta, LayerAttentionOptions.default(HEAD_DIM)))
    assert outputs[1].shape[0] == 8 and torch.isfinite(outputs[1]).all()
    assert (outputs[1][: len(DECODES)] - outputs[0]).abs().max().item() <= MAX_ABS_ERROR


def test_split_kv_fills_the_gpu_at_batch_one_and_not_past_the_context():
    tuning = TritonTuning()  # 132 SMs, partitions of 256 keys or more, 64 at most
    assert decode_partition_size(span=2048, num_seqs=1, num_kv_heads=8, tuning=tuning) == 256  # 8 partitions
    # 33 partitions of 8 KV heads: 264 programs, two per SM.
    assert decode_partition_size(span=128 * 1024, num_seqs=1, num_kv_heads=8, tuning=tuning) == 4000
    assert decode_partition_size(span=2048, num_seqs=256, num_kv_heads=8, tuning=tuning) == 2048  # one: full
    assert decode_partition_size(span=100, num_seqs=1, num_kv_heads=8, tuning=tuning) == 256  # one, short
    size = decode_partition_size(span=10**6, num_seqs=1, num_kv_heads=1, tuning=tuning)
    assert size % tuning.decode_block_n == 0 and -(-(10**6) // size) <= tuning.max_partitions


def test_the_prefill_grid_is_varlen():
    rows = (PlanRow(0, 3, 3, [1]), PlanRow(3, 20, 36, [2, 3, 4]), PlanRow(23, 1, 9, [5]))
    assert prefill_programs(rows, block_q=8) == [0, 0, 1, 0, 1, 8, 1, 16, 2, 0]


def test_the_plans_tables_reuse_their_buffers_step_after_step():
    backend = TritonPagedAttention(CPU, TINY)
    addresses = []
    for seed in (0, 1):
        *_, meta = build_step(MIXED, page_size=16, group=1, seed=seed)
        backend.plan(meta)
        step = backend._step
        addresses.append((step.decode.block_table.data_ptr(), step.prefill.chunks.data_ptr()))
        assert step.decode.block_table.dtype == torch.int32
    assert addresses[0] == addresses[1]


def test_without_cuda_or_the_interpreter_the_backend_is_refused_naming_why(monkeypatch):
    """(With kernels really compiled for a GPU: tests/test_triton_compile.py, in a process of its own.)"""
    from gpu_runtime.attention import cpu_kernel, triton_paged

    assert make_attention_backend("triton", CPU).name == "triton"  # interpreted kernels: the tests' CPU runs
    monkeypatch.delenv("TRITON_INTERPRET")  # interpreted kernels, but the interpreter off: they would fail
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        make_attention_backend("triton", CPU)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_kernels, "prefill_kernel", object())  # as if compiled for a GPU
    with pytest.raises(ValueError, match="triton needs a CUDA device, not cpu.*interpreter.*TRITON_INTERPRET=1"):
        make_attention_backend("triton", CPU)
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        triton_paged.TritonPagedAttention(CPU)
    for kernel_built in (True, False):  # auto's two CPU choices, without building the C++ kernel for this
        monkeypatch.setattr(cpu_kernel, "load_cpu_kernel", lambda built=kernel_built: object() if built else None)
        assert make_attention_backend("auto", CPU).name == ("cpu_paged" if kernel_built else "torch")


# The engine on the interpreter: a GQA-4 Llama on pages of 16, and Gemma 2 (a 16-token window on every second layer,
# soft-capped logits, its own query scale) on pages of 1; prompt chunks of at most 16 tokens beside running decodes,
# then every prompt again with its full pages found in the prefix cache. Few, short prompts: the interpreter runs
# every program of every layer of every step in Python.
ENGINE_CASES = {"llama-gqa": (LLAMA_GQA, 16), "gemma2": (GEMMA2, 1)}
NUM_TOKENS = 6


def engine_prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(20)]  # longer than a page of 16 and than Gemma's window
    return [shared + [7, 8, 9], [rng.randrange(256) for _ in range(3)], shared + list(range(30, 41)), [42]]


# Partitions of 16 keys: the engine's decodes (contexts up to 37) split their context and combine the partitions.
ENGINE_TUNING = TritonTuning(decode_block_n=16, prefill_block_m=32, prefill_block_n=32, min_partition=16, num_sms=16)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=str)
def test_greedy_equals_transformers_on_the_interpreter(case, tmp_path, monkeypatch):
    from gpu_runtime.attention import triton_paged

    monkeypatch.setattr(triton_paged, "TritonTuning", lambda: ENGINE_TUNING)  # the backend's CPU tuning
    spec, page_size = ENGINE_CASES[case]
    model_dir = write_checkpoint(tmp_path / case, spec)
    prompts = engine_prompts()
    expected = transformers_greedy(model_dir, prompts, NUM_TOKENS)
    llm = LLM(
        str(model_dir),
        device="cpu",
        attention_backend="triton",
        page_size=page_size,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    assert llm.engine.attention_backend == "triton"
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(requests, greedy)] == expected
    again = llm.generate(requests, greedy)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) >= 2 * 16
