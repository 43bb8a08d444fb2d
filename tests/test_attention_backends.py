"""Every attention backend gives transformers' greedy tokens, whatever the page size, caching and chunking; the
batched one makes one attention call per layer per phase of a step, whatever the batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import NUM_REFERENCE_TOKENS

from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=NUM_REFERENCE_TOKENS, temperature=0, ignore_eos=True)
NUM_PROMPTS = 8  # of the reference's 16: enough to mix lengths 1-300 in one batch, at half the cost


# Each backend meets both page sizes and each of caching and chunking both on and off: four runs that cover every
# pair of settings (a full grid would be eight runs per backend for no pair not already met).
SETTINGS = [(4, True, True), (4, False, False), (16, True, False), (16, False, True)]


BACKENDS = ["cpu_paged", "batched", "torch"]


@pytest.mark.parametrize(("page_size", "caching", "chunked"), SETTINGS, ids=lambda value: str(value).lower())
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reference_case", ["llama-gqa"], indirect=True)
def test_greedy_equals_transformers(reference_case, backend, page_size, caching, chunked):
    check_greedy_equals_transformers(reference_case, backend, page_size, caching, chunked)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reference_case", ["qwen2"], indirect=True)
def test_greedy_equals_transformers_with_qkv_bias(reference_case, backend):
    check_greedy_equals_transformers(reference_case, backend, page_size=16, caching=True, chunked=True)


def check_greedy_equals_transformers(reference_case, backend, page_size, caching, chunked):
    model_dir, prompts, expected = reference_case
    prompts, expected = prompts[:NUM_PROMPTS], expected[:NUM_PROMPTS]
    llm = LLM(
        str(model_dir),
        device="cpu",
        attention_backend=backend,
        page_size=page_size,
        enable_prefix_caching=caching,
        enable_chunked_prefill=chunked,
        # Chunked: 96 tokens a step, so long prompts take several chunks beside running decodes.
        max_num_batched_tokens=96 if chunked else 512,
        max_num_seqs=4,
    )
    requests = [{"prompt_token_ids": p} for p in prompts]
    first = [o.outputs[0].token_ids for o in llm.generate(requests, GREEDY)]
    assert first == expected
    if caching:  # again: every prompt's full pages are now found in the cache and only the rest is computed
        again = llm.generate(requests, GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0


ATTENTION_OPS = ("aten::scaled_dot_product_attention", "tokend::paged_decode")


def attention_calls_in_one_step(engine: LLMEngine) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        engine.step()
    return sum(event.name in ATTENTION_OPS for event in profiler.events())


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("backend", ["cpu_paged", "batched"])
def test_batched_backends_make_one_call_per_layer_per_phase(llama_dir, backend, batch):
    config = EngineConfig(model=str(llama_dir), device="cpu", attention_backend=backend, max_num_seqs=16)
    engine = LLMEngine(config)
    num_layers = engine.model_config.num_layers
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"old-{i}", [5 + i, 6, 7, 8, 9] * (i + 1), params)
    engine.step()  # every prompt's prefill
    assert attention_calls_in_one_step(engine) == num_layers  # decodes only, whatever the batch
    engine.add_request("new", list(range(10, 40)), params)
    assert attention_calls_in_one_step(engine) == 2 * num_layers  # the newcomer's prefill beside the decodes


def test_reference_backend_calls_once_per_sequence(llama_dir):
    """The per-sequence reference, for contrast: its calls grow with the batch (why it is not the default)."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", attention_backend="torch", max_num_seqs=16))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for i in range(6):
        engine.add_request(str(i), [3, 4, 5 + i], params)
    engine.step()
    assert attention_calls_in_one_step(engine) == 6 * engine.model_config.num_layers


def test_without_the_cpu_kernel_auto_falls_back_to_the_reference_and_says_why(tmp_path):
    """A machine that cannot build the kernel (here: its directory cannot be made) still serves, on torch."""
    not_a_directory = tmp_path / "kernels"
    not_a_directory.write_text("")  # a file where the build directory's parent should be: even root cannot
    code = (
        "import torch; from gpu_runtime.attention.backend import make_attention_backend; "
        "print(make_attention_backend('auto', torch.device('cpu')).name)"
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(not_a_directory / "build")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch"
    assert "no CPU attention kernel" in result.stderr
