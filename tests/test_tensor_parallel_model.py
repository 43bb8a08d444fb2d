"""Tensor parallelism's model and weights layer: over two real rank processes (gloo on the CPU), the sharded model
gives world size 1's logits and transformers', at every position of chunked prompts and decodes over paged K/V;
each rank holds and loads about half the weights; heads that do not split are refused, naming both numbers.

The ranks are tests/tp_ranks.py, started as processes; they talk to this test through files only."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoints import GEMMA2, GEMMA3, MIXTRAL, PHI3, QWEN3, QWEN3_MOE, write_checkpoint
from safetensors.torch import load_file, save_file
from tp_ranks import CPU, run_steps

from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.cpu_weights import can_prepack, prepack_linears
from gpu_runtime.model.load_progress import weight_bytes
from gpu_runtime.model.loader import load_model
from gpu_runtime.model.tensor_parallel import TensorParallel, check_divisible

RANKS_SCRIPT = Path(__file__).with_name("tp_ranks.py")
RANKS_TIMEOUT_S = 900  # a hang's guard, not a speed bound: two ranks on a loaded 2-core machine are slow
WORLD_SIZE = 2

# 4 query / 2 KV heads; every bias on (o_proj's and down_proj's are row-parallel: rank 0 adds them); tied
# embeddings; a vocabulary of 259, odd, so the second rank's shard is padded.
LLAMA_4Q_2KV = {
    "kind": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True,
    "tie_word_embeddings": True, "vocab_size": 259,
}  # fmt: skip
QWEN2_4Q_2KV = {"kind": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 258}  # q/k/v bias


def write_model(directory: Path, spec: dict, seed: int = 0, **overrides) -> Path:
    """A small random transformers model saved with save_pretrained; its biases drawn at random too (transformers
    initialises them to zero, which would hide a bias added twice or never)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = {**spec, **overrides}
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = classes[spec.pop("kind")]
    config = config_class(
        hidden_size=spec.pop("hidden_size", 64), intermediate_size=spec.pop("intermediate_size", 160),
        num_hidden_layers=2, max_position_embeddings=spec.pop("max_position_embeddings", 256),
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, **spec,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    return directory


def run_ranks(job_dir: Path, job: dict) -> None:
    """Runs WORLD_SIZE rank processes on `job` and waits for them; any rank failing (or the group outliving
    RANKS_TIMEOUT_S) fails the test with the ranks' output. Every rank process is gone when this returns."""
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two ranks on a loaded 2-core machine
    ranks, logs = [], []
    try:
        for rank in range(WORLD_SIZE):
            log = (job_dir / f"rank{rank}.log").open("w")
            logs.append(log)
            command = [sys.executable, str(RANKS_SCRIPT), str(job_dir), str(rank), str(WORLD_SIZE)]
            ranks.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        codes = [process.wait(timeout=max(0.1, deadline - time.monotonic())) for process in ranks]
    except subprocess.TimeoutExpired:
        codes = [f"still running after {RANKS_TIMEOUT_S} s"]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for log in logs:
            log.close()
    if any(codes):
        output = "\n".join(f"rank {r}:\n{(job_dir / f'rank{r}.log').read_text()[-3000:]}" for r in range(WORLD_SIZE))
        pytest.fail(f"ranks exited with {codes}:\n{output}")


def transformers_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def single_process_logits(model_dir: Path, job: dict) -> list[torch.Tensor]:
    """World size 1: today's model, no tensor parallelism, through the same steps."""
    config = load_model_config(model_dir)
    model = load_model(model_dir, config, make_attention_backend(job["backend"], CPU), torch.float32, CPU)
    if can_prepack(CPU, torch.float32):
        prepack_linears(model)
    return run_steps(model, job)


@pytest.mark.parametrize(
    ("spec", "backend"),
    [(LLAMA_4Q_2KV, "batched"), (QWEN2_4Q_2KV, "torch")],
    ids=["llama-4q-2kv-biases-tied-odd-vocab", "qwen2-qkv-bias"],
)
def test_two_ranks_give_the_single_process_logits_and_transformers(tmp_path, spec, backend):
    model_dir = write_model(tmp_path / "model", spec)
    generator = torch.Generator().manual_seed(1)
    vocab = spec["vocab_size"]
    lengths = [(11, 3), (6, 2), (17, 3)]  # (prompt, decodes): chunks of 8 split two of the prompts
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n, _ in lengths]
    continuations = [torch.randint(0, vocab, (n,), generator=generator).tolist() for _, n in lengths]
    job = {"model_dir": str(model_dir), "backend": backend, "prompts": prompts, "continuations": continuations,
           "chunk": 8}  # fmt: skip
    run_ranks(tmp_path / "job", job)
    sharded = load_file(str(tmp_path / "job" / "logits.safetensors"))
    single = single_process_logits(model_dir, job)
    for index, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        expected = transformers_logits(model_dir, prompt + continuation)
        got = sharded[f"seq{index}"]
        assert got.shape == expected.shape == (len(prompt) + len(continuation), vocab)
        torch.testing.assert_close(got, single[index], rtol=0, atol=1e-4)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    ("spec", "backend"),
    [(QWEN3, "auto"), (MIXTRAL, "batched"), (QWEN3_MOE, "auto"), (GEMMA2, "auto"), (GEMMA3, "torch"), (PHI3, "auto")],
    ids=["qwen3", "mixtral", "qwen3-moe", "gemma2", "gemma3", "phi3"],
)
def test_two_ranks_give_transformers_logits_for_the_newer_families(tmp_path, spec, backend):
    """Per-head q/k norms replicated, every expert split the Megatron way (the router replicated), Gemma's four norms
    replicated and its soft-capped logits capped per shard before the gather, Phi-3's fused checkpoint tensors split
    piece by piece; windows shorter than the prompts."""
    model_dir = write_checkpoint(tmp_path / "model", spec)
    generator = torch.Generator().manual_seed(1)
    lengths = [(37, 3), (6, 2), (21, 4)]  # (prompt, decodes): chunks of 8, two prompts longer than Gemma's window
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n, _ in lengths]
    continuations = [torch.randint(0, 256, (n,), generator=generator).tolist() for _, n in lengths]
    job = {"model_dir": str(model_dir), "backend": backend, "prompts": prompts, "continuations": continuations,
           "chunk": 8}  # fmt: skip
    run_ranks(tmp_path / "job", job)
    sharded = load_file(str(tmp_path / "job" / "logits.safetensors"))
    for index, (prompt, continuation) in enumerate(zip(prompts, continuations, strict=True)):
        expected = transformers_logits(model_dir, prompt + continuation)
        torch.testing.assert_close(sharded[f"seq{index}"], expected, rtol=0, atol=1e-4)


def test_each_rank_holds_and_loads_about_half_the_weights(tmp_path):
    # ~24 MB of float32 weights, 2 layers: big enough that a whole matrix on a rank would show.
    spec = {**LLAMA_4Q_2KV, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
    model_dir = write_model(tmp_path / "model", spec, hidden_size=512, intermediate_size=1408)
    run_ranks(tmp_path / "job", {"model_dir": str(model_dir), "backend": "torch", "prompts": [], "measure_load": True})
    whole = weight_bytes(model_dir / "model.safetensors")
    config = load_model_config(model_dir)
    replicated = (2 * config.num_layers + 1) * config.hidden_size * 4  # the norms
    # The vocabulary, 259, pads to 2 x 130 rows: one zero row more in the embedding and in lm_head.
    padding = 2 * config.hidden_size * 4
    half = (whole + padding - replicated) / WORLD_SIZE + replicated
    report = {}
    for rank in range(WORLD_SIZE):
        stats = json.loads((tmp_path / "job" / f"rank{rank}.json").read_text())
        held, peak = stats["parameter_bytes"], stats["load_peak_bytes"]
        report[rank] = (held, peak)
        assert held == half
        # The shard plus the rotary tables (~0.3 MB here) and one tensor's shard while it is read: never a whole
        # matrix, let alone the whole model.
        assert held <= peak <= 1.1 * held < 0.6 * whole
    print(f"whole model {whole} B; per rank (parameters, loading peak): {report}")


def test_heads_that_do_not_split_are_refused_naming_both_numbers(tmp_path):
    model_dir = write_model(tmp_path / "model", QWEN2_4Q_2KV)
    config = load_model_config(model_dir)
    check_divisible(config, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 3 does not divide num_attention_heads 4"):
        check_divisible(config, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide num_key_value_heads 2"):
        check_divisible(config, 4)


def test_a_checkpoint_tensor_of_the_wrong_size_is_refused_naming_it(tmp_path):
    model_dir = write_model(tmp_path / "model", QWEN2_4Q_2KV)
    weights = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    weights[name] = torch.cat([weights[name], weights[name]])  # 4 KV heads' rows where the config says 2
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = load_model_config(model_dir)
    # Rank 1's load alone, in this process: loading runs no collective, so it needs no group.
    with pytest.raises(ValueError, match=re.escape(f"{name!r} has shape (64, 64), expected 32 along dimension 0")):
        load_model(model_dir, config, make_attention_backend("torch", CPU), torch.float32, CPU, tp=TensorParallel(1, 2))
