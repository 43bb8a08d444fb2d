"""Checkpoint loading: sharded checkpoints (with model.safetensors.index.json) and broken directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import LLAMA_GQA, QWEN2, write_checkpoint
from safetensors.torch import load_file, save_file

from gpu_runtime import LLM, SamplingParams

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [256, 200]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KV_BYTES = 4 << 20
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json")


def greedy_tokens(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", kv_cache_bytes=KV_BYTES)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [out.outputs[0].token_ids for out in outputs]


def copy_side_files(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)


def shard_by_hand(source: Path, target: Path, num_shards: int) -> Path:
    """Splits model.safetensors round-robin, so q/k/v and gate/up of one layer land in different files."""
    copy_side_files(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]
    weight_map = {name: files[i % num_shards] for i, name in enumerate(names)}
    for file in files:
        shard = {n: tensors[n] for n in names if weight_map[n] == file}
        save_file(shard, str(target / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return target


def hf_greedy(model_dir: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(GREEDY.max_tokens):
                next_id = model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
            results.append(ids[0, len(prompt) :].tolist())
    return results


@pytest.fixture(scope="module", params=[LLAMA_GQA, QWEN2], ids=["llama-gqa", "qwen2"])
def single(request, tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("single"), request.param, hidden_size=64, intermediate_size=96)


@pytest.fixture(scope="module")
def single_tokens(single) -> list[list[int]]:
    return greedy_tokens(single)


def test_single_file_matches_transformers(single, single_tokens):
    # The anchor for the sharded tests below: the single-file load is the right model.
    assert all(len(t) == GREEDY.max_tokens for t in single_tokens)
    assert single_tokens == hf_greedy(single)


def test_hand_sharded_checkpoint_generates_the_same_tokens(single, single_tokens, tmp_path):
    num_shards = 4
    sharded = shard_by_hand(single, tmp_path / "sharded", num_shards)
    assert not (sharded / "model.safetensors").exists()
    assert len(list(sharded.glob("*.safetensors"))) == num_shards
    assert greedy_tokens(sharded) == single_tokens


def test_transformers_sharded_checkpoint_generates_the_same_tokens(single, single_tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "hf-sharded"
    model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    model.save_pretrained(sharded, max_shard_size="50KB")
    shutil.copy(single / "tokenizer.json", sharded / "tokenizer.json")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert greedy_tokens(sharded) == single_tokens


def test_index_decides_which_files_are_read(single, single_tokens, tmp_path):
    """A stray *.safetensors file the index does not name (a leftover download) is ignored."""
    sharded = shard_by_hand(single, tmp_path / "sharded", 3)
    junk = {name: torch.zeros_like(t) for name, t in load_file(str(single / "model.safetensors")).items()}
    save_file(junk, str(sharded / "zz-stale.safetensors"))
    assert greedy_tokens(sharded) == single_tokens


# -- broken checkpoints -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), LLAMA_GQA, hidden_size=64, intermediate_size=96)


def _without(source: Path, target: Path, missing: str) -> Path:
    copy_side_files(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    assert missing in tensors
    del tensors[missing]
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize(
    "missing",
    [
        "model.norm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",  # LLAMA_GQA does not tie embeddings
        "model.layers.1.self_attn.k_proj.weight",  # one piece of a fused parameter
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ],
)
def test_checkpoint_missing_a_tensor_raises(llama, tmp_path, missing):
    broken = _without(llama, tmp_path / "broken", missing)
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(broken), device="cpu", kv_cache_bytes=KV_BYTES)


def test_sharded_checkpoint_missing_a_tensor_raises(llama, tmp_path):
    sharded = shard_by_hand(llama, tmp_path / "sharded", 3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.mlp.gate_proj.weight"
    shard = sharded / index["weight_map"][victim]
    tensors = load_file(str(shard))
    del tensors[victim]
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match="lacks weights"):
        LLM(str(sharded), device="cpu", kv_cache_bytes=KV_BYTES)


def test_directory_without_config_json_raises(llama, tmp_path):
    target = tmp_path / "no-config"
    target.mkdir()
    shutil.copy(llama / "model.safetensors", target / "model.safetensors")
    shutil.copy(llama / "tokenizer.json", target / "tokenizer.json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES)


def test_directory_that_does_not_exist_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path / "nowhere"), device="cpu", kv_cache_bytes=KV_BYTES)


def test_directory_without_weights_raises(llama, tmp_path):
    target = tmp_path / "no-weights"
    copy_side_files(llama, target)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES)


def test_dummy_load_format_serves_a_shape_without_its_weights(llama, tmp_path):
    """vLLM's --load-format dummy: benchmarks of a model's shape (an 8B one on a GPU box) need no weight files."""
    target = tmp_path / "no-weights"
    copy_side_files(llama, target)
    llm = LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES, load_format="dummy")
    weights = [p for name, p in llm.engine.runner.model.named_parameters() if not name.endswith("norm.weight")]
    assert all(0.01 < float(w.detach().std()) < 0.03 for w in weights)  # drawn as a fresh Llama's: std 0.02
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy)[0].outputs[0].token_ids) == 6


def test_unexpected_tensor_raises(llama, tmp_path):
    target = tmp_path / "extra"
    copy_side_files(llama, target)
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="q_norm"):
        LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES)


def test_misshaped_unfused_tensor_raises(llama, tmp_path):
    target = tmp_path / "misshaped"
    copy_side_files(llama, target)
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.*shape"):
        LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES)


def test_misshaped_fused_piece_raises(llama, tmp_path):
    target = tmp_path / "misshaped-fused"
    copy_side_files(llama, target)
    tensors = load_file(str(llama / "model.safetensors"))
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.cat([k, k])  # twice the rows of 2 KV heads
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj"):
        LLM(str(target), device="cpu", kv_cache_bytes=KV_BYTES)


def test_index_naming_a_missing_shard_raises_value_error(llama, tmp_path):
    sharded = shard_by_hand(llama, tmp_path / "sharded", 3)
    next(iter(sorted(sharded.glob("model-*.safetensors")))).unlink()
    with pytest.raises(ValueError):
        LLM(str(sharded), device="cpu", kv_cache_bytes=KV_BYTES)
