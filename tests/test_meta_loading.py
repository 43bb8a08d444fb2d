"""The model is built on the meta device and materialised once, in its dtype: loading never makes a randomly
initialised (or float32) copy; tied embeddings stay tied and the rotary tables are real. And which dtype "auto" is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoints import LLAMA3_ROPE, LLAMA_GQA, write_checkpoint
from safetensors.torch import load_file, save_file
from torch.profiler import ProfilerActivity, profile

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.attention.torch_paged import TorchPagedAttention
from gpu_runtime.device import checkpoint_dtype, resolve_dtype
from gpu_runtime.memory_profile import model_bytes
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.model.loader import load_model
from gpu_runtime.model.rope import RotaryEmbedding

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def allocator_peak_bytes(build) -> tuple[int, object]:
    """The peak of PyTorch's CPU allocations while `build` runs (from the profiler's record of every allocation and
    free, in order), and what it returned (kept alive until the end, so its memory counts).

    Not counted: safetensors' mapping of each checkpoint file (UntypedStorage.from_file, the one allocation made
    outside any operator): file-backed pages of the page cache, which the kernel drops under pressure, not a copy.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = build()
    live = peak = 0
    mapped: list[int] = []
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        usage = event.self_cpu_memory_usage
        if event.name == "[memory]" and usage > 0:
            mapped.append(usage)
            continue
        if event.name == "[memory]" and -usage in mapped:  # a mapping released
            mapped.remove(-usage)
            continue
        live += usage
        peak = max(peak, live)
    return peak, result


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """~92 MB of float32 weights (46 MB in bfloat16): big enough that an extra copy cannot hide in the slack."""
    directory = tmp_path_factory.mktemp("wide")
    return write_checkpoint(directory, LLAMA_GQA, hidden_size=1024, intermediate_size=2816)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_loading_allocates_the_weights_once(wide_dir, dtype):
    config = load_model_config(wide_dir)
    backend = TorchPagedAttention()
    peak, model = allocator_peak_bytes(lambda: load_model(wide_dir, config, backend, dtype, CPU))
    weights = model_bytes(model)
    assert weights > 40 << 20
    # Slack: the rotary tables' float32 temporaries (a few of 1024 positions x 128 wide, ~0.5 MiB each) while
    # they are computed; 10% of the weights is far above that and far below a second copy.
    assert weights <= peak <= 1.1 * weights
    # The measure would see a second copy: building the model eagerly, as the loader used to, initialises every
    # parameter in float32 before converting it.
    eager_peak, _ = allocator_peak_bytes(lambda: LlamaForCausalLM(config, backend, dtype).to(dtype))
    assert eager_peak >= (2 if dtype == torch.bfloat16 else 1) * weights


def test_materialised_model_has_no_meta_tensor_and_real_rotary_tables(wide_dir):
    config = load_model_config(wide_dir)
    model = load_model(wide_dir, config, TorchPagedAttention(), torch.bfloat16, CPU)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert all(t.device == CPU and t.dtype == torch.bfloat16 for t in tensors.values())
    reference = RotaryEmbedding(config.rope, config.head_dim, config.max_model_len, torch.bfloat16)
    rotary = model.rotary  # one table for every layer
    assert torch.equal(rotary.cos_table, reference.cos_table) and torch.equal(rotary.sin_table, reference.sin_table)
    checkpoint = load_file(str(wide_dir / "model.safetensors"))
    norm = checkpoint["model.layers.1.post_attention_layernorm.weight"].to(torch.bfloat16)
    assert torch.equal(model.layers[1].post_attention_layernorm.weight, norm)


def test_tied_embeddings_stay_one_tensor_after_materialising(tmp_path):
    model_dir = write_checkpoint(tmp_path, LLAMA3_ROPE)
    config = load_model_config(model_dir)
    assert config.tie_word_embeddings
    model = load_model(model_dir, config, TorchPagedAttention(), torch.float32, CPU)
    assert model.lm_head.weight is model.embed_tokens.weight
    embeddings = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(model.lm_head.weight, embeddings)


# -- dtype "auto" ------------------------------------------------------------------------------------------------


def bfloat16_checkpoint(source: Path, target: Path) -> Path:
    """The same model saved in bfloat16, its config.json saying so (as a Hugging Face bf16 download does)."""
    target.mkdir()
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(str(source / "model.safetensors")).items()}
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw.pop("dtype", None)
    (target / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}))  # the pre-v5 key
    (target / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    return target


@pytest.mark.parametrize(
    ("checkpoint", "bf16_supported", "expected"),
    [
        ("bfloat16", True, torch.bfloat16),
        ("bfloat16", False, torch.float16),  # a GPU before Ampere
        ("float16", True, torch.float16),
        ("float16", False, torch.float16),
        ("float32", True, torch.bfloat16),  # as vLLM: full precision is not served by default
        ("float32", False, torch.float16),
        (None, True, torch.bfloat16),
    ],
)
def test_auto_on_cuda_follows_the_checkpoint(checkpoint, bf16_supported, expected):
    assert resolve_dtype("auto", CUDA, checkpoint, bf16_supported=bf16_supported) == expected


@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32", None])
def test_auto_off_cuda_is_float32_and_an_explicit_dtype_wins(checkpoint):
    assert resolve_dtype("auto", CPU, checkpoint) == torch.float32
    assert resolve_dtype("float16", CUDA, checkpoint, bf16_supported=True) == torch.float16
    assert resolve_dtype("bfloat16", CPU, checkpoint) == torch.bfloat16


def test_a_bfloat16_checkpoint_serves_in_float32_on_cpu_and_in_bfloat16_when_asked(llama_dir, tmp_path):
    bf16_dir = bfloat16_checkpoint(llama_dir, tmp_path / "bf16")
    assert checkpoint_dtype(bf16_dir) == "bfloat16" and checkpoint_dtype(llama_dir) == "float32"
    assert resolve_dtype("auto", CUDA, checkpoint_dtype(bf16_dir), bf16_supported=True) == torch.bfloat16
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for dtype, expected in [("auto", torch.float32), ("bfloat16", torch.bfloat16)]:
        llm = LLM(str(bf16_dir), device="cpu", dtype=dtype, kv_cache_bytes=4 << 20)
        assert llm.engine.dtype == expected
        assert {p.dtype for p in llm.engine.runner.model.parameters()} == {expected}
        out = llm.generate([{"prompt_token_ids": [256, 1, 2, 3]}], greedy)
        assert len(out[0].outputs[0].token_ids) == 6


# -- on a GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_loading_on_cuda_peaks_at_the_weights_plus_one_checkpoint_tensor(wide_dir):
    config = load_model_config(wide_dir)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(CUDA)
    torch.cuda.reset_peak_memory_stats(CUDA)
    model = load_model(wide_dir, config, TorchPagedAttention(), torch.bfloat16, CUDA)
    peak = torch.cuda.max_memory_allocated(CUDA) - before
    weights = model_bytes(model)
    largest = max(t.numel() * t.element_size() for t in load_file(str(wide_dir / "model.safetensors")).values())
    # A float32 tensor is converted on the device after its copy: one at a time, so one at most on top.
    assert weights <= peak <= weights + largest + (1 << 20)
    assert model.lm_head.weight.device.type == "cuda"
