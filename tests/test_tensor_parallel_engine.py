"""Tensor parallelism through the engine: LLM(..., tensor_parallel_size=2) starts a second rank process (gloo on the
CPU) and generates (and embeds) what one process does, and what transformers does, with prefix caching and chunked
prefill on; a lost rank is noticed; closing leaves no rank behind; a model whose heads do not split is refused at
start."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from checkpoints import QWEN2, write_checkpoint
from conftest import kv_bytes_for, random_prompts, transformers_greedy
from gguf import GGMLQuantizationType
from test_gguf import write_tiny_gguf

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.gguf.convert import converted_dir
from gpu_runtime.ipc.pooling import PoolingParams, PoolingType
from gpu_runtime.tp.rank_group import RankLost

LLAMA_4Q_2KV = {"kind": "llama", "num_attention_heads": 4, "num_key_value_heads": 2}
NUM_TOKENS = 12
# Small pages and a small token budget: prompts are chunked over steps, and the 16 prompts' shared first 24 tokens
# come from the prefix cache once the first of them has run.
OPTIONS = {"page_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 48, "enable_prefix_caching": True}


def prompts_sharing_a_prefix() -> list[list[int]]:
    prefix = random_prompts(1, 24, 24, seed=7)[0]
    return [prefix + tail for tail in random_prompts(16, 1, 60, seed=8)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def rank_processes() -> list[int]:
    """The pids of this test process's rank children still running (their title: `tokend: rank 1/2 ...`)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        if int(parent) == os.getpid() and command.startswith(b"tokend: rank ") and "zombie" not in status:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("spec", [LLAMA_4Q_2KV, QWEN2], ids=["llama-4q-2kv", "qwen2-qkv-bias"])
def test_two_ranks_generate_what_one_process_and_transformers_do(tmp_path, spec):
    model_dir = write_checkpoint(tmp_path / "model", spec)
    prompts = prompts_sharing_a_prefix()
    expected = transformers_greedy(model_dir, prompts, NUM_TOKENS)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True, logprobs=3)
    requests = [{"prompt_token_ids": p} for p in prompts]
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)  # the ranks score prompts alike too
    with LLM(str(model_dir), **OPTIONS) as one:
        single = one.generate(requests, greedy)
        single_scored = one.generate(requests[:3], scoring)
        single_embedded = one.embed(requests[:4], PoolingParams(PoolingType.MEAN))
    with LLM(str(model_dir), tensor_parallel_size=2, **OPTIONS) as two:
        assert len(rank_processes()) == 1
        split = two.generate(requests, greedy)
        split_scored = two.generate(requests[:3], scoring)
        split_embedded = two.embed(requests[:4], PoolingParams(PoolingType.MEAN))  # steps where no row samples
    assert rank_processes() == []  # closing stopped rank 1
    for a, b in zip(single_embedded, split_embedded, strict=True):
        assert b.outputs.embedding == pytest.approx(a.outputs.embedding, abs=1e-5)
    for a, b in zip(single_scored, split_scored, strict=True):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        assert [e.logprob for e in b.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in a.prompt_logprobs[1:]],
                                                                           abs=1e-4)  # fmt: skip
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in single] == expected
    # The shared prefix came from the cache for the prompts admitted after the first one's pages filled.
    assert sum(o.num_cached_tokens for o in split) >= 8 * 24
    for a, b in zip(single, split, strict=True):
        for mine, theirs in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert mine.token_id == theirs.token_id
            assert abs(mine.logprob - theirs.logprob) <= 1e-4
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


def test_with_a_host_tier_each_rank_keeps_its_heads_pages_and_outputs_stay_those_of_transformers(tmp_path):
    """--kv-offload-bytes under tensor parallelism: rank 0 decides what goes to the host tier and back, rank 1
    replays the copies on its own heads' pages (with each step's plan), so the revisited prompts' pages loaded back
    from host memory hold every rank's K/V: the outputs are transformers' greedy ones."""
    model_dir = write_checkpoint(tmp_path / "model", LLAMA_4Q_2KV)
    prompts = random_prompts(12, 20, 80, seed=9)
    expected = transformers_greedy(model_dir, prompts, NUM_TOKENS)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    # 40 pages of 4 tokens per rank (each rank's pages hold its half of the heads): a round of prompts evicts the
    # round before it.
    options = {**OPTIONS, "max_num_seqs": 4, "kv_cache_bytes": kv_bytes_for(model_dir, 4, 20),
               "kv_offload_bytes": kv_bytes_for(model_dir, 4, 200)}  # fmt: skip
    with LLM(str(model_dir), tensor_parallel_size=2, **options) as two:
        first = two.generate([{"prompt_token_ids": p} for p in prompts[:6]], greedy)
        second = two.generate([{"prompt_token_ids": p} for p in prompts[6:] + prompts[:6]], greedy)
        assert two.engine.kv.host.num_loaded > 0 and two.engine.kv.num_host_hit_tokens > 0
    assert [o.outputs[0].token_ids for o in first + second] == expected[:6] + expected[6:] + expected[:6]


def test_a_killed_rank_is_noticed_and_closing_leaves_no_rank(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model", LLAMA_4Q_2KV)
    llm = LLM(str(model_dir), tensor_parallel_size=2, **OPTIONS)
    try:
        assert rank_processes() == llm.engine.ranks.pids
        llm.engine.check_ranks()  # all there
        os.kill(llm.engine.ranks.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60  # a hang guard: the kernel ends a killed process at once
        with pytest.raises(RankLost, match=r"rank 1 \(pid \d+\) exited with status -9"):
            while time.monotonic() < deadline:
                llm.engine.check_ranks()
                time.sleep(0.02)
    finally:
        llm.close()
    assert rank_processes() == []


def test_heads_that_do_not_split_are_refused_before_any_rank_starts(tmp_path):
    model_dir = write_checkpoint(tmp_path / "model", LLAMA_4Q_2KV)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads 4"):
        LLM(str(model_dir), tensor_parallel_size=3)
    assert rank_processes() == []


def test_a_quantized_gguf_under_two_ranks_serves_its_float32_conversion(tmp_path):
    """quantization "auto" (the default) keeps GGUF blocks only where one process multiplies them; no rank does, so
    two ranks serve the float32 conversion instead of refusing the file, and generate what one process serving that
    conversion does."""
    path = tmp_path / "tiny-q8_0.gguf"
    write_tiny_gguf(path, GGMLQuantizationType.Q8_0)
    requests = [{"prompt_token_ids": p} for p in random_prompts(4, 4, 20, seed=3)]
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(path), quantization="none", max_num_seqs=4) as one:
        single = [o.outputs[0].token_ids for o in one.generate(requests, greedy)]
    with LLM(str(path), tensor_parallel_size=2, max_num_seqs=4) as two:
        assert two.engine.model_dir == converted_dir(path)  # not the "-blocks" conversion
        split = [o.outputs[0].token_ids for o in two.generate(requests, greedy)]
    assert split == single and all(len(tokens) == NUM_TOKENS for tokens in split)
