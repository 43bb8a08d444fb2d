"""The newer families against transformers itself, on random float32 checkpoints it wrote (tests/checkpoints.py):
greedy tokens equal for 16 prompts x 48 tokens, batched, with prefix caching and chunked prefill on and prompts that
share a prefix; full logits within 1e-4 at every position, teacher-forced through chunked prefill and decodes over
the paged KV cache."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
from checkpoints import (
    GEMMA2,
    GEMMA3,
    GEMMA_WINDOW,
    MISTRAL,
    MIXTRAL,
    PHI3,
    PHI3_LONGROPE,
    QWEN3,
    QWEN3_MOE,
    QWEN3_MOE_NORMED,
    QWEN3_TIED,
    write_checkpoint,
)
from conftest import NUM_REFERENCE_TOKENS, transformers_greedy
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tp_ranks import run_steps

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.kv_cache.kv_pool import page_bytes
from gpu_runtime.memory_profile import kv_layout_of
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.llama import place_kv_groups
from gpu_runtime.model.loader import load_model, safetensors_files
from gpu_runtime.model.moe import SparseMoeBlock
from gpu_runtime.model.qwen3 import QKNormAttention
from gpu_runtime.model.registry import architecture, split_table_key, split_tensor_name
from gpu_runtime.model.tensor_parallel import TensorParallel, check_divisible
from gpu_runtime.model.tp_checkpoint import CheckpointShards

pytestmark = pytest.mark.engine

CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=NUM_REFERENCE_TOKENS, temperature=0, ignore_eos=True)
SHARED_PREFIX = 40  # tokens the first half of the prompts share: longer than a Gemma test model's window
assert SHARED_PREFIX > GEMMA_WINDOW

# name: (checkpoint spec, tokend's architecture name)
FAMILIES = {
    "qwen3": (QWEN3, "qwen3"),
    "qwen3-tied": (QWEN3_TIED, "qwen3"),
    "mixtral": (MIXTRAL, "mixtral"),
    "qwen3-moe": (QWEN3_MOE, "qwen3_moe"),
    "qwen3-moe-normed": (QWEN3_MOE_NORMED, "qwen3_moe"),
    "gemma2": (GEMMA2, "gemma2"),
    "gemma3": (GEMMA3, "gemma3_text"),
    "phi3": (PHI3, "phi3"),
    "phi3-longrope": (PHI3_LONGROPE, "phi3"),
    "mistral": (MISTRAL, "mistral"),
}
# Greedy tokens, per family and attention backend: "auto" is the CPU's default (cpu_paged); the windowed, soft-capped
# families on every backend, since each one implements the options its own way. (The variants left out share their
# decoder with one here: their logits are compared below.)
GREEDY_CASES = [
    ("qwen3", "auto"),
    ("mixtral", "auto"),
    ("qwen3-moe", "auto"),
    *[(family, backend) for family in ("gemma2", "gemma3") for backend in ("auto", "batched", "torch")],
    ("phi3", "auto"),
    ("phi3-longrope", "auto"),
    ("mistral", "auto"),
]


def family_prompts(count: int = 16, seed: int = 3) -> list[list[int]]:
    """Half the prompts share a SHARED_PREFIX-token prefix (found in the prefix cache once one has run), the rest
    are their own; 1 to 120 tokens after it."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(SHARED_PREFIX)]
    prompts = []
    for index in range(count):
        own = [rng.randrange(256) for _ in range(rng.randint(1, 120))]
        prompts.append(prefix + own if index % 2 == 0 else own)
    return prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each family's checkpoint, written once for the module."""
    made = {}

    def checkpoint(name: str):
        if name not in made:
            made[name] = write_checkpoint(tmp_path_factory.mktemp(name), FAMILIES[name][0])
        return made[name]

    return checkpoint


@pytest.fixture(scope="module")
def references(checkpoints):
    """Each family's (checkpoint, prompts, transformers' greedy continuations), computed once for the module."""
    made = {}

    def reference(name: str):
        if name not in made:
            model_dir, prompts = checkpoints(name), family_prompts()
            made[name] = model_dir, prompts, transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
        return made[name]

    return reference


@pytest.fixture
def family_case(request, references):
    """(checkpoint, prompts, transformers' greedy continuations) of the family named by the test's parameter."""
    return references(request.param)


# Measured: about 30 s a family on 2 idle cores, 190-285 s for Mixtral's with three busy loops beside the suite
# (its 300 s default hang guard fired once): the guard here leaves room for that.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("family_case", "backend"), GREEDY_CASES, indirect=["family_case"])
def test_greedy_tokens_equal_transformers_with_caching_and_chunking(family_case, backend):
    model_dir, prompts, expected = family_case
    llm = LLM(
        str(model_dir),
        device="cpu",
        attention_backend=backend,
        page_size=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=64,  # long prompts take several chunks beside running decodes
        max_num_seqs=8,
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(requests, GREEDY)
    assert [o.outputs[0].token_ids for o in first] == expected
    again = llm.generate(requests, GREEDY)  # every prompt's full pages now come from the cache
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) >= SHARED_PREFIX * len(prompts) // 2


def window_prompts(count: int, seed: int = 5) -> list[list[int]]:
    """Prompts 4 to 8 times a test model's window long."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(4 * GEMMA_WINDOW, 8 * GEMMA_WINDOW))] for _ in range(count)]


def windowed_llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), device="cpu", page_size=8, enable_prefix_caching=True, enable_chunked_prefill=True,
               max_num_batched_tokens=32, debug_checks=True, **options)  # fmt: skip


def pages_held_at_most(chunk: int, page_size: int = 8) -> int:
    """A sequence's pages after a step where every layer slides: from its window's oldest position on, plus the
    next step's chunk (tests/test_window_pages.py shows the bookkeeping)."""
    return -(-(GEMMA_WINDOW - 1 + chunk) // page_size) + 1


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_a_windowed_sequence_holds_one_window_of_pages_and_still_equals_transformers(checkpoints, name):
    """One sequence at a time, prompts 4-8x the window: the pages the pool has in use after every step stay within
    one window plus a chunk (a third of what the longest sequence would hold), and the tokens are transformers'."""
    model_dir, prompts = checkpoints(name), window_prompts(3)
    expected = transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
    llm = windowed_llm(model_dir, max_num_seqs=1)
    engine = llm.engine
    assert engine.kv.window == GEMMA_WINDOW
    for prompt, want in zip(prompts, expected, strict=True):
        engine.add_request("r", prompt, GREEDY)
        tokens, used = [], []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.new_token_ids
            used.append(engine.kv.num_used_pages)
            engine.check_integrity()
        assert tokens == want
        longest = engine.kv.num_pages_for(len(prompt) + NUM_REFERENCE_TOKENS)
        assert max(used) <= pages_held_at_most(chunk=32) < longest / 2
    assert engine.kv.num_used_pages == 0


def test_gemma3_holds_its_global_layers_pages_and_one_window_for_its_sliding_layers(checkpoints):
    """Gemma 3's layers in KV groups (two global layers, four sliding ones: three groups of two), prompts 4-8x the
    window, one sequence at a time: after every step the pool's pages in use are at most the global group's pages of
    the whole sequence plus one window and a chunk per sliding group (where one table for every layer would hold
    three times the whole sequence), and the tokens are transformers'."""
    model_dir, prompts = checkpoints("gemma3"), window_prompts(3)
    expected = transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
    llm = windowed_llm(model_dir, max_num_seqs=1)
    engine = llm.engine
    assert engine.kv.windows == (None, GEMMA_WINDOW, GEMMA_WINDOW)
    for prompt, want in zip(prompts, expected, strict=True):
        engine.add_request("r", prompt, GREEDY)
        tokens, steps = [], []  # steps: (pages in use, tokens computed) after each step
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.new_token_ids
            running = engine.scheduler.running
            steps.append((engine.kv.num_used_pages, running[0].num_computed_tokens if running else 0))
            engine.check_integrity()
        assert tokens == want
        assert all(used <= engine.kv.num_pages_for(computed) + 2 * pages_held_at_most(chunk=32)
                   for used, computed in steps)  # fmt: skip
        longest = engine.kv.num_pages_for(len(prompt) + NUM_REFERENCE_TOKENS)
        assert max(used for used, _ in steps) < 2 * longest  # one table for all six layers: 3 x longest
    assert engine.kv.num_used_pages == 0


def test_windowed_sequences_run_together_in_a_pool_too_small_to_hold_them_whole(checkpoints):
    """Eight sequences at once in a pool with room for under half their full length: pages given back behind
    the window keep them all running (no preemption), and every output is still transformers'."""
    model_dir, prompts = checkpoints("mistral"), window_prompts(8, seed=6)
    expected = transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
    config = load_model_config(model_dir)
    num_pages = 8 * pages_held_at_most(chunk=32)
    whole = sum(-(-(len(p) + NUM_REFERENCE_TOKENS) // 8) for p in prompts)
    assert num_pages < whole / 2
    llm = windowed_llm(model_dir, max_num_seqs=8, kv_cache_bytes=num_pages * page_bytes(config, 8, torch.float32))
    assert llm.engine.kv.num_pages == num_pages
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.scheduler.num_preemptions == 0


def test_a_windowed_request_longer_than_the_whole_pool_is_served_and_found_again(checkpoints):
    """A pool of 15 pages (one window and a chunk are 7) serves requests of 21 and 22 pages, exactly; each sent
    again is a prefix-cache hit found by its window, its head pages having been evicted as it ran."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (8 * GEMMA_WINDOW, 7 * GEMMA_WINDOW + 5)]
    model_dir = checkpoints("mistral")
    expected = transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
    num_pages = pages_held_at_most(chunk=32) + 8
    config = load_model_config(model_dir)
    llm = windowed_llm(model_dir, max_num_seqs=1, kv_cache_bytes=num_pages * page_bytes(config, 8, torch.float32))
    assert llm.engine.kv.num_pages == num_pages < min(-(-(len(p) + NUM_REFERENCE_TOKENS) // 8) for p in prompts)
    for prompt, want in zip(prompts, expected, strict=True):
        first, again = (llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0] for _ in range(2))
        assert first.outputs[0].token_ids == again.outputs[0].token_ids == want
        assert again.num_cached_tokens == (len(prompt) - 1) // 8 * 8
        assert llm.engine.kv.lookup(llm.engine.kv.hasher.hash_tokens(prompt)).page_ids == []  # its head is gone


def transformers_logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def teacher_forced_case(seed: int = 1):
    """Three sequences: prompts of 45, 6 and 23 tokens in chunks of 8 (one sharing nothing with the others), then
    4, 3 and 5 decodes of given tokens."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [(45, 4), (6, 3), (23, 5)]
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n, _ in lengths]
    continuations = [torch.randint(0, 256, (n,), generator=generator).tolist() for _, n in lengths]
    return {"prompts": prompts, "continuations": continuations, "chunk": 8}


def check_teacher_forced_logits(model_dir, backend: str) -> None:
    config = load_model_config(model_dir)
    model = load_model(model_dir, config, make_attention_backend(backend, CPU), torch.float32, CPU)
    job = teacher_forced_case()
    logits = run_steps(model, job)
    for got, prompt, continuation in zip(logits, job["prompts"], job["continuations"], strict=True):
        expected = transformers_logits(model_dir, prompt + continuation)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_at_every_position_equal_transformers(checkpoints, name):
    check_teacher_forced_logits(checkpoints(name), "auto")


@pytest.mark.parametrize("backend", ["batched", "torch"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_windowed_logits_equal_transformers_on_every_backend(checkpoints, name, backend):
    check_teacher_forced_logits(checkpoints(name), backend)


def checkpoint_tensor_names(model_dir) -> list[str]:
    return [name for path in safetensors_files(model_dir) for name in safe_open(str(path), "pt").keys()]  # noqa: SIM118


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_tensor_of_the_checkpoint_is_in_its_split_table(checkpoints, name):
    model_dir = checkpoints(name)
    splits = architecture(FAMILIES[name][1]).tp_splits
    names = checkpoint_tensor_names(model_dir)
    assert names
    assert [n for n in names if split_table_key(split_tensor_name(n)[1]) not in splits] == []


def test_qwen3_reads_its_own_head_dim_and_norms_every_head(checkpoints):
    config = load_model_config(checkpoints("qwen3"))
    assert (config.architecture, config.head_dim, config.hidden_size // config.num_heads) == ("qwen3", 32, 16)
    model = load_model(checkpoints("qwen3"), config, make_attention_backend("torch", CPU), torch.float32, CPU)
    assert all(isinstance(layer.self_attn, QKNormAttention) for layer in model.layers)


def test_qwen3_moe_layers_are_sparse_where_step_and_mlp_only_layers_say(checkpoints):
    model_dir = checkpoints("qwen3-moe")  # decoder_sparse_step 2, mlp_only_layers [3]: only layer 1 is sparse
    config = load_model_config(model_dir)
    assert config.moe.layers == (False, True, False, False)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.renormalize) == (6, 3, False)
    model = load_model(model_dir, config, make_attention_backend("torch", CPU), torch.float32, CPU)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers] == [False, True, False, False]
    normed = load_model_config(checkpoints("qwen3-moe-normed"))
    assert normed.moe.layers == (False, True, True, True) and normed.moe.renormalize


def test_an_expert_width_that_does_not_split_is_refused_naming_both_numbers(checkpoints):
    config = load_model_config(checkpoints("qwen3-moe"))
    check_divisible(config, 2)  # every expert's 48 columns: 24 a rank
    odd = dataclasses.replace(config, moe=dataclasses.replace(config.moe, intermediate_size=49))
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 does not divide moe_intermediate_size 49"):
        check_divisible(odd, 2)


def test_per_expert_tensors_are_stacked_into_one_parameter(checkpoints):
    model_dir = checkpoints("mixtral")
    config = load_model_config(model_dir)
    model = load_model(model_dir, config, make_attention_backend("torch", CPU), torch.float32, CPU)
    weights = load_file(str(model_dir / "model.safetensors"))
    experts = model.layers[2].block_sparse_moe.experts
    width = config.moe.intermediate_size
    assert experts.gate_up_proj.shape == (6, 2 * width, config.hidden_size)
    prefix = "model.layers.2.block_sparse_moe.experts.4"
    assert torch.equal(experts.gate_up_proj[4, :width], weights[f"{prefix}.w1.weight"])
    assert torch.equal(experts.gate_up_proj[4, width:], weights[f"{prefix}.w3.weight"])
    assert torch.equal(experts.down_proj[4], weights[f"{prefix}.w2.weight"])


def test_a_missing_or_extra_expert_is_refused_naming_it(checkpoints, tmp_path):
    source = checkpoints("mixtral")
    weights = load_file(str(source / "model.safetensors"))
    config_json = (source / "config.json").read_text()
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text(config_json)
    save_file({k: v for k, v in weights.items() if ".experts.5.w3" not in k}, str(missing / "model.safetensors"))
    config = load_model_config(missing)
    with pytest.raises(ValueError, match=r"lacks weights for .*experts\.gate_up_proj\[5\]\[1\]"):
        load_model(missing, config, make_attention_backend("torch", CPU), torch.float32, CPU)
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    (fewer / "config.json").write_text(json.dumps({**json.loads(config_json), "num_local_experts": 5}))
    (fewer / "model.safetensors").symlink_to(source / "model.safetensors")
    name = "model.layers.0.block_sparse_moe.experts.5.w1.weight"
    with pytest.raises(ValueError, match=rf"{name!r} is expert 5, but the model has 5 experts"):
        load_model(fewer, load_model_config(fewer), make_attention_backend("torch", CPU), torch.float32, CPU)


def test_gemma_layers_alternate_windows_scales_and_rotations(checkpoints):
    gemma2 = load_model_config(checkpoints("gemma2"))
    assert gemma2.layer_types == ("sliding_attention", "full_attention") * 2
    assert (gemma2.sliding_window, gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (GEMMA_WINDOW, 4.0, 8.0)
    assert gemma2.query_scale == 24**-0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    model = load_model(checkpoints("gemma3"), load_model_config(checkpoints("gemma3")),
                       make_attention_backend("torch", CPU), torch.float32, CPU)  # fmt: skip
    windows = [layer.self_attn.options.sliding_window for layer in model.layers]
    assert windows == [GEMMA_WINDOW, GEMMA_WINDOW, None] * 2
    assert {layer.self_attn.options.logit_softcap for layer in model.layers} == {None}  # Gemma 3 caps no scores
    assert model.rotary.rope.rope_type == "linear" and model.local_rotary.rope.theta == 10000.0
    assert all(isinstance(layer.self_attn, QKNormAttention) for layer in model.layers)


@pytest.mark.parametrize(("reads_group_tables", "hybrid", "windows"), [
    (True, True, (None, GEMMA_WINDOW, GEMMA_WINDOW)),
    (False, True, (None,)),  # a backend whose plan copies one block table (triton's)
    (True, False, (None,)),  # disable_hybrid_kv_cache_manager, or a prefill or decode worker
])  # fmt: skip
def test_gemma3_is_laid_out_in_kv_groups_where_its_backend_reads_them(checkpoints, reads_group_tables, hybrid,
                                                                      windows):  # fmt: skip
    backend = make_attention_backend("torch", CPU)
    backend.reads_group_tables = reads_group_tables
    model = load_model(checkpoints("gemma3"), load_model_config(checkpoints("gemma3")), backend, torch.float32, CPU)
    layout = kv_layout_of(model, hybrid)
    assert layout.windows == windows
    place_kv_groups(model, layout)
    groups = [layer.self_attn.kv_group for layer in model.layers]
    assert groups == ([1, 1, 0, 2, 2, 0] if len(windows) > 1 else [0] * 6)  # the global layers' group first


def _config_dir(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


GEMMA3_V4_CONFIG = {  # as transformers 4 wrote google/gemma-3-4b-it's text config: no layer_types, no rope_parameters
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
    "intermediate_size": 10240, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024, "sliding_window_pattern": 6, "max_position_embeddings": 131072,
    "final_logit_softcapping": None, "attn_logit_softcapping": None,
}  # fmt: skip


def test_a_transformers_4_gemma3_config_reads_its_pattern_and_two_thetas(tmp_path):
    config = load_model_config(_config_dir(tmp_path, GEMMA3_V4_CONFIG))
    assert config.layer_types == ("sliding_attention",) * 5 + (
        "full_attention",
        "sliding_attention",
        "sliding_attention",
    )
    assert (config.rope.theta, config.rope.rope_type, config.rope.factor) == (1000000.0, "linear", 8.0)
    assert (config.local_rope.theta, config.local_rope.rope_type) == (10000.0, "default")
    assert config.query_scale == 1 / 16 and config.max_model_len == 131072


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
        ({"hidden_activation": "relu"}, "hidden_act='relu' is not supported"),
        ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
         r"architectures=\['Gemma3ForConditionalGeneration'\] model_type='gemma3' is not supported"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types=.* is not 8 of"),
    ],
    ids=["bidirectional", "activation", "vision-model", "layer-types"],
)  # fmt: skip
def test_what_gemma_cannot_run_is_refused_naming_the_key(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        load_model_config(_config_dir(tmp_path, {**GEMMA3_V4_CONFIG, **change}))


def test_phi3_loads_its_fused_tensors_by_name_and_reads_longrope(checkpoints):
    model_dir = checkpoints("phi3-longrope")
    config = load_model_config(model_dir)
    rope = config.rope
    assert (rope.rope_type, rope.original_max_position_embeddings, rope.partial_rotary_factor) == (
        "longrope",
        1024,
        0.75,
    )
    assert rope.attention_factor == pytest.approx((1 + math.log(4) / math.log(1024)) ** 0.5)
    model = load_model(model_dir, config, make_attention_backend("torch", CPU), torch.float32, CPU)
    weights = load_file(str(model_dir / "model.safetensors"))
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight, weights["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, weights["model.layers.1.mlp.gate_up_proj.weight"])
    assert model.rotary.cos_table.shape[-1] == 12  # 3/4 of the 16 dimensions rotate
    windowed = load_model(checkpoints("phi3"), load_model_config(checkpoints("phi3")),
                          make_attention_backend("torch", CPU), torch.float32, CPU)  # fmt: skip
    assert {layer.self_attn.options.sliding_window for layer in windowed.layers} == {GEMMA_WINDOW}


def test_phi3s_fused_tensors_split_piece_by_piece_over_ranks(checkpoints):
    """Rank r's qkv_proj is its q heads, then its KV heads' k, then their v: each piece split, not the whole."""
    model_dir = checkpoints("phi3")
    config = load_model_config(model_dir)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        whole = f.get_tensor(name)
        q, k, v = whole.split([64, 32, 32])
        for rank in range(2):
            part = CheckpointShards(config, TensorParallel(rank, 2), architecture("phi3").tp_splits).read(
                name, f.get_slice(name)
            )
            halves = [piece.chunk(2)[rank] for piece in (q, k, v)]
            assert torch.equal(part, torch.cat(halves))


def test_a_transformers_4_phi3_config_reads_su_scaling_and_its_top_level_keys(tmp_path):
    raw = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 32,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "rope_scaling": {"type": "su", "short_factor": [1.05] * 48, "long_factor": [1.5] * 48},
        "sliding_window": 262144, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    }  # fmt: skip
    config = load_model_config(_config_dir(tmp_path, raw))
    assert (config.rope.rope_type, config.rope.original_max_position_embeddings) == ("longrope", 4096)
    assert config.rope.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    with pytest.raises(ValueError, match="short_factor/long_factor must have 48 values"):
        load_model_config(_config_dir(tmp_path, {**raw, "rope_scaling": {**raw["rope_scaling"], "long_factor": [1.0]}}))
    llama = {**raw, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    with pytest.raises(ValueError, match=r"rope_type='su' is not supported \(default, linear, llama3\)"):
        load_model_config(_config_dir(tmp_path, llama))
