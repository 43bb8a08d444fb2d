"""GGUF weights served in their blocks (quantization "auto") against the same file dequantized to float32 ("none").

Both paths multiply the very same block values (dequantization is exact); the decode path rounds each 32 values of
x to int16 (gpu_runtime/quant/linear.py DECODE_ACTIVATION_BITS: each value off by at most amax/65534, the bound
test_quant_kernel.py checks). Through SmolLM2's 30 layers that moves the teacher-forced logits by a relative 1.3e-3
(median of the prompts' worst positions; 2.2e-3 at most, asserted under 5e-3) and leaves top-1 100% the same (at
least 99% asserted); Q8_0's greedy tokens stay identical. x kept in float32 (32 bits) moves them by 1e-5, summation
order only; llama.cpp's 8-bit x by up to 0.25, and top-1 falls to ~98% (SmolLM2's activations have outliers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from test_gguf import write_tiny_gguf

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.default_model import ensure_default_model, resolve_model_dir
from gpu_runtime.gguf.convert import converted_dir
from gpu_runtime.model import loader, registry
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.llama import RMSNorm
from gpu_runtime.quant import linear as quant_linear
from gpu_runtime.quant.blocks import QUANTIZED_WEIGHTS_FILE, BlockFormat, is_matrix_weight
from gpu_runtime.quant.kernel import load_quant_kernel
from gpu_runtime.quant.linear import QuantizedEmbedding, QuantizedLinear
from gpu_runtime.quant.norm import KernelRMSNorm
from gpu_runtime.quant.plan import QuantizedPlan, plan_quantized, swap_modules

pytestmark = pytest.mark.engine

NUM_PROMPTS, NUM_TOKENS = 16, 48
PROMPTS = [
    "The capital of France is", "Once upon a time", "def add(a, b):", "The three primary colours are",
    "Water boils at", "My favourite book is", "To make a cup of tea,", "The theory of relativity says",
    "In 1492,", "A haiku about the sea:", "import numpy as np\n", "The best way to learn a language is",
    "Photosynthesis is", "Dear Sir or Madam,", "Step 1: preheat the oven", "Why is the sky blue?",
]  # fmt: skip


@pytest.fixture(scope="module")
def kernel():
    if load_quant_kernel() is None:
        pytest.skip("the quantized-matmul kernel cannot be built here (the engine then serves dequantized weights)")


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0)
    return path


def _model(llm: LLM):
    return llm.engine.runner.model


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_q8_0_gguf_is_served_in_its_blocks_at_a_fraction_of_the_bytes(kernel, q8_gguf):
    quantized = LLM(str(q8_gguf), quantization="auto", max_num_seqs=4)
    linears = [m for m in _model(quantized).modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 4 * len(_model(quantized).layers) + 1  # qkv, o, gate_up, down a layer; lm_head
    assert all(m.block.type is GGMLQuantizationType.Q8_0 for m in linears)
    # The norms between the kernel's matmuls are the kernel's too; the float path keeps torch's.
    assert all(type(m) is not RMSNorm for m in _model(quantized).modules())
    assert any(isinstance(m, KernelRMSNorm) for m in _model(quantized).modules())
    dequantized = LLM(str(q8_gguf), quantization="none", max_num_seqs=4)
    assert not any(isinstance(m, QuantizedLinear | KernelRMSNorm) for m in _model(dequantized).modules())
    assert quantized.engine.memory.weights_bytes < 0.5 * dequantized.engine.memory.weights_bytes
    # The tiny model's random logits are all but tied, so its tokens are not compared here; the real model's are.
    assert all(len(tokens) == NUM_TOKENS for tokens in _greedy(quantized, PROMPTS[:4]))


def _q8_0_default_model(directory: Path) -> Path:
    """SmolLM2-135M-Instruct with every matrix requantized to Q8_0 (gguf's own quantizer), as a converted
    directory: a real model's Q8_0 weights, without writing the whole GGUF file."""
    source = ensure_default_model()
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors, kept = {}, {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if is_matrix_weight(name):
            tensor = torch.from_numpy(quantize(tensor.float().numpy(), GGMLQuantizationType.Q8_0))
            kept[name] = "Q8_0"
        tensors[name] = tensor
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / QUANTIZED_WEIGHTS_FILE).write_text(json.dumps({"version": 1, "tensors": kept}))
    return directory


def test_q8_0_greedy_tokens_equal_the_dequantized_float32_path(kernel, tmp_path, monkeypatch):
    model_dir = _q8_0_default_model(tmp_path / "smollm2-q8_0")
    quantized = LLM(str(model_dir), max_num_seqs=NUM_PROMPTS, max_model_len=512)
    assert isinstance(_model(quantized).layers[0].self_attn.qkv_proj, QuantizedLinear)
    prompts = [{"prompt_token_ids": quantized.tokenizer.encode(p)} for p in PROMPTS]
    served = _greedy(quantized, prompts)
    del quantized
    # The same blocks dequantized at load (what a machine without the kernel serves): the float32 path.
    monkeypatch.setattr(loader, "can_serve_blocks", lambda device, dtype: False)
    dequantized = LLM(str(model_dir), max_num_seqs=NUM_PROMPTS, max_model_len=512)
    assert not any(isinstance(m, QuantizedLinear) for m in _model(dequantized).modules())
    assert served == _greedy(dequantized, prompts)


def test_the_conversion_keeps_blocks_in_a_directory_of_its_own(q8_gguf):
    blocks, floats = resolve_model_dir(str(q8_gguf), "auto"), resolve_model_dir(str(q8_gguf), "none")
    assert blocks != floats and floats == converted_dir(q8_gguf)
    kept = json.loads((blocks / QUANTIZED_WEIGHTS_FILE).read_text())["tensors"]
    assert kept["model.layers.0.self_attn.q_proj.weight"] == "Q8_0" and "model.embed_tokens.weight" in kept
    assert not any("norm" in name for name in kept) and not (floats / QUANTIZED_WEIGHTS_FILE).exists()


def test_tensor_parallelism_refuses_quantized_weights_naming_the_tensor(q8_gguf):
    with pytest.raises(ValueError, match=r"quantization: tensor 'model\.[^']+' is stored as Q8_0 blocks"):
        plan_quantized(resolve_model_dir(str(q8_gguf), "auto"), tensor_parallel=True)


def test_a_fused_layer_whose_pieces_differ_in_type_stays_float(q8_gguf):
    """Q4_K_M files mix types within q/k/v: one kernel call multiplies one type, so such a layer is dequantized."""
    model_dir = resolve_model_dir(str(q8_gguf), "none")
    config = load_model_config(model_dir)
    entry = registry.architecture(config.architecture)
    q8, q4 = BlockFormat.of("Q8_0"), BlockFormat.of("Q4_0")
    layer = "model.layers.0"
    stored = {f"{layer}.self_attn.q_proj.weight": q8, f"{layer}.self_attn.k_proj.weight": q8,
              f"{layer}.self_attn.v_proj.weight": q4, f"{layer}.mlp.gate_proj.weight": q4,
              f"{layer}.mlp.up_proj.weight": q4, "model.embed_tokens.weight": q8}  # fmt: skip
    plan = QuantizedPlan(stored)
    with torch.device("meta"):
        backend = make_attention_backend("torch", torch.device("cpu"))
        model = entry.model_class(config, backend, torch.float32, None)
        swap_modules(model, entry, plan, tied=config.tie_word_embeddings)
    first = model.layers[0]
    assert type(first.self_attn.qkv_proj) is torch.nn.Linear and isinstance(first.mlp.gate_up_proj, QuantizedLinear)
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear) == config.tie_word_embeddings
    assert f"{layer}.self_attn.v_proj.weight" not in plan.served and f"{layer}.mlp.up_proj.weight" in plan.served


def _teacher_forced_logits(llm: LLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence's logits at every position, from one prefill of the whole of it."""
    model, hidden = _model(llm), []
    hook = model.register_forward_hook(lambda module, args, output: hidden.append(output.detach().clone()))
    try:
        llm.generate([{"prompt_token_ids": s} for s in sequences], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        hook.remove()
    rows = torch.cat(hidden)
    assert rows.shape[0] == sum(map(len, sequences))  # one prefill step per sequence, no chunking
    with torch.no_grad():
        return list(model.compute_logits(rows).split([len(s) for s in sequences]))


def test_the_4_bit_default_model_agrees_with_its_float32_path_teacher_forced(kernel, monkeypatch):
    # No prefix caching: each teacher-forced prefill must compute every position of its sequence.
    options = {"max_num_seqs": NUM_PROMPTS, "max_model_len": 512, "enable_prefix_caching": False}
    dequantized = LLM(quantization="none", **options)
    tokenizer = dequantized.tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    greedy = _greedy(dequantized, [{"prompt_token_ids": p} for p in prompts])
    sequences = [p + t for p, t in zip(prompts, greedy, strict=True)]
    reference = _teacher_forced_logits(dequantized, sequences)
    del dequantized
    quantized = LLM(quantization="auto", **options)
    assert isinstance(_model(quantized).layers[0].mlp.gate_up_proj, QuantizedLinear)
    assert _model(quantized).layers[0].mlp.gate_up_proj.block.type is GGMLQuantizationType.Q4_1
    # Every row through the decode path (not the prefill GEMM), and with x rounded to int16 as a decode of fewer than
    # FLOAT_ACTIVATION_ROWS rows has it: as if each position were decoded one at a time.
    monkeypatch.setattr(quant_linear, "MAX_DECODE_ROWS", 1 << 30)
    monkeypatch.setattr(quant_linear, "FLOAT_ACTIVATION_ROWS", 1 << 30)
    served = _teacher_forced_logits(quantized, sequences)
    agree = total = 0
    for prompt, ref, got in zip(prompts, reference, served, strict=True):
        ref, got = ref[len(prompt) - 1 : -1], got[len(prompt) - 1 : -1]  # the positions that chose a new token
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        total += ref.shape[0]
        relative = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        assert relative.max() < 5e-3, relative.max()
    assert total == NUM_PROMPTS * NUM_TOKENS and agree / total >= 0.99, agree / total
    assert quantized.engine.memory.weights_bytes < 0.3 * LLM_weights_bytes_float()


def LLM_weights_bytes_float() -> int:  # noqa: N802 (reads as what it measures)
    """The float path's weight bytes as it served them (a fresh engine: the first was dropped to save memory)."""
    with LLM(quantization="none", max_num_seqs=1, max_model_len=64) as llm:
        return llm.engine.memory.weights_bytes


def test_the_float_conversion_is_what_transformers_reads():
    """`ensure_default_model()` (tests compare it with transformers) stays the dequantized float32 checkpoint."""
    assert not (ensure_default_model() / QUANTIZED_WEIGHTS_FILE).exists()
    assert (ensure_default_model("auto") / QUANTIZED_WEIGHTS_FILE).is_file()
