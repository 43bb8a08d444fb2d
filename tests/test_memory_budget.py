"""The KV pool's size: vLLM's formula with given numbers, the cap at what the running batch can use, the profiled
largest step (run through the real runner on the CPU), and what the engine reports it decided."""

from __future__ import annotations

import pytest
import torch
from conftest import kv_bytes_for

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.attention.torch_paged import TorchPagedAttention
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.kv_cache.kv_pool import page_bytes
from gpu_runtime.memory_budget import GiB, max_useful_pages, pages_from_budget, pages_from_device_memory
from gpu_runtime.memory_profile import StepShape, build_step, largest_steps, model_bytes, run_step
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.loader import load_model

MiB = 1 << 20


def device_pages(**overrides) -> int:
    numbers = {
        "total_bytes": 80 * GiB,
        "gpu_memory_utilization": 0.9,
        "weights_bytes": 16 * GiB,
        "peak_activation_bytes": 4 * GiB,
        "page_bytes": 2 * MiB,
        "max_pages": 10**9,
    }
    return pages_from_device_memory(**{**numbers, **overrides})


def test_pages_are_the_share_less_weights_and_activations():
    # 0.9 x 80 GiB = 72 GiB; less 16 GiB of weights and 4 GiB of activations: 52 GiB of 2 MiB pages.
    assert device_pages() == 52 * 512
    assert device_pages(non_torch_bytes=1 * GiB) == 51 * 512
    assert device_pages(gpu_memory_utilization=0.5) == 20 * 512
    # A part of a page left over is not a page.
    assert device_pages(peak_activation_bytes=4 * GiB + 1) == 52 * 512 - 1


def test_pages_are_capped_at_what_the_running_batch_can_fill():
    cap = max_useful_pages(max_num_seqs=64, max_model_len=8192, page_size=16)
    assert cap == 64 * 512
    assert device_pages(total_bytes=141 * GiB, max_pages=cap) == cap  # an H200 has room for far more
    assert max_useful_pages(max_num_seqs=2, max_model_len=17, page_size=16) == 4  # a partial page counts


def test_nothing_left_names_gpu_memory_utilization_and_the_numbers_in_gib():
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: 0\.9 .*80\.00 GiB.*72\.00 GiB.*70\.00 GiB"):
        device_pages(weights_bytes=70 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        device_pages(weights_bytes=68 * GiB, peak_activation_bytes=4 * GiB - 1 * MiB)  # 1 MiB: half a page


def test_an_explicit_budget_is_capped_too():
    assert pages_from_budget(512 * MiB, page_bytes=1 * MiB, page_size=16, max_pages=10**6) == 512
    assert pages_from_budget(512 * MiB, page_bytes=1 * MiB, page_size=16, max_pages=8) == 8
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        pages_from_budget(MiB - 1, page_bytes=1 * MiB, page_size=16, max_pages=8)


# -- the largest step --------------------------------------------------------------------------------------------


def test_the_most_tokens_spread_the_budget_over_max_num_seqs_fresh_prompts():
    most, _ = largest_steps(EngineConfig(max_num_seqs=64, max_num_batched_tokens=4100), max_model_len=8192)
    assert most.num_decodes == 0 and all(cached == 0 for cached, _ in most.prefills)
    new = [n for _, n in most.prefills]
    assert (sum(new), len(new), set(new)) == (4100, 64, {64, 65})
    # No prompt is longer than the context, even when the budget would allow it.
    most, _ = largest_steps(EngineConfig(max_num_seqs=1, max_num_batched_tokens=4096), max_model_len=100)
    assert most == StepShape(((0, 100),))


def test_the_longest_attention_is_a_last_chunk_over_the_whole_context_beside_decodes():
    _, longest = largest_steps(EngineConfig(max_num_seqs=8, max_num_batched_tokens=512), max_model_len=2048)
    assert longest == StepShape(((2048 - 512, 512),), num_decodes=7, decode_context=2047)


@pytest.mark.parametrize("options", [{"enable_chunked_prefill": False}, {"scheduling": "static"}])
def test_a_prompt_that_runs_whole_is_profiled_at_full_length(options):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, **options)
    _, longest = largest_steps(config, max_model_len=2048)
    # Past the token budget: it runs whole.
    assert longest == StepShape(((0, 2048),), num_decodes=7, decode_context=2047)


@pytest.mark.parametrize("chunked", [True, False])
def test_largest_steps_run_through_the_real_runner_and_sampler(llama_dir, chunked):
    config = EngineConfig(
        model=str(llama_dir), max_num_seqs=4, max_num_batched_tokens=64, page_size=16, enable_chunked_prefill=chunked
    )
    model_config = load_model_config(llama_dir)
    model = load_model(llama_dir, model_config, TorchPagedAttention(), torch.float32, torch.device("cpu"))
    for shape in largest_steps(config, model_config.max_model_len):
        runner, step = build_step(shape, model, model_config, config, torch.float32, torch.device("cpu"))
        assert [(w.seq.num_computed_tokens, w.num_new_tokens) for w in step.prefills] == list(shape.prefills)
        assert len(step.decodes) == shape.num_decodes
        # Just large enough: the prompts' pages, and one set of pages that every decode reads.
        pages = sum(-(-(cached + new) // 16) for cached, new in shape.prefills) + -(-(shape.decode_context + 1) // 16)
        assert runner.pool.num_pages == pages
        tokens = run_step(runner, step)
        assert len(tokens) == len(shape.prefills) + shape.num_decodes  # every row sampled
        assert all(0 <= t < model_config.vocab_size for t in tokens)


# -- what the engine decided -------------------------------------------------------------------------------------


def test_cpu_default_budget_is_capped_for_a_small_batch(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_num_seqs=2, max_num_batched_tokens=64, max_model_len=40)
    memory = llm.engine.memory
    # Without the cap, 512 MiB would buy thousands of pages; two sequences of 40 tokens use 2 x 3.
    assert memory.max_useful_pages == 2 * 3
    assert llm.engine.kv.num_pages == memory.num_pages == 6
    assert memory.page_bytes == page_bytes(llm.engine.model_config, 16, torch.float32)
    assert memory.weights_bytes == model_bytes(llm.engine.runner.model) > 0
    assert memory.peak_activation_bytes == 0  # no profiling run off CUDA
    fields = memory.as_log_fields()
    assert fields["kv_pages"] == 6 and fields["kv_cache_bytes"] == 6 * memory.page_bytes
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 3, SamplingParams(max_tokens=30, temperature=0))
    assert all(len(o.outputs[0].token_ids) == 30 for o in out)


def test_an_explicit_budget_below_the_cap_is_kept_exactly(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", page_size=4, max_num_seqs=4, kv_cache_bytes=kv_bytes_for(llama_dir, 4, 60))
    assert llm.engine.kv.num_pages == 60


# -- on a GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_is_the_share_left_by_the_weights_and_the_profiled_step(llama_dir):
    llm = LLM(str(llama_dir), device="cuda", max_num_seqs=4, max_num_batched_tokens=256, gpu_memory_utilization=0.5)
    memory = llm.engine.memory
    assert memory.peak_activation_bytes > 0  # the profiling run happened
    assert memory.weights_bytes == model_bytes(llm.engine.runner.model)
    expected = pages_from_device_memory(
        total_bytes=torch.cuda.mem_get_info()[1],
        gpu_memory_utilization=0.5,
        weights_bytes=memory.weights_bytes,
        peak_activation_bytes=memory.peak_activation_bytes,
        non_torch_bytes=memory.non_torch_bytes,
        page_bytes=memory.page_bytes,
        max_pages=memory.max_useful_pages,
    )
    assert llm.engine.kv.num_pages == memory.num_pages == expected == memory.max_useful_pages  # a tiny model: capped
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(str(llama_dir), device="cuda", gpu_memory_utilization=1e-7)  # ~14 KiB of the device: not the weights
