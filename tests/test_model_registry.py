"""The model registry: an architecture is one entry (model class, weight map, tensor-parallel split table, GGUF
names), the loader builds what the entry names, and under tensor parallelism a tensor no table lists is an error
naming it, never replicated."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from checkpoints import LLAMA_GQA, write_checkpoint
from safetensors import safe_open

from gpu_runtime.attention.backend import make_attention_backend
from gpu_runtime.model import registry
from gpu_runtime.model.architectures import llama
from gpu_runtime.model.config import load_model_config
from gpu_runtime.model.llama import LlamaForCausalLM
from gpu_runtime.model.loader import load_model, safetensors_files
from gpu_runtime.model.registry import split_tensor_name
from gpu_runtime.model.tensor_parallel import TensorParallel
from gpu_runtime.model.tp_checkpoint import CheckpointShards

CPU = torch.device("cpu")


class FakeForCausalLM(LlamaForCausalLM):
    """A new architecture's model class: Llama's decoder, told apart by its type alone."""


FAKE = dataclasses.replace(
    llama.ARCHITECTURE, name="fake", hf_classes=("FakeForCausalLM",), model_class=FakeForCausalLM, gguf=None
)


@pytest.fixture
def fake_registered():
    registry.register(FAKE)
    yield FAKE
    registry.unregister(FAKE.name)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("registry-llama"), LLAMA_GQA)


def _renamed(checkpoint, tmp_path, hf_class: str, model_type: str):
    """The checkpoint's weights under another config.json architecture name."""
    for path in checkpoint.iterdir():
        (tmp_path / path.name).symlink_to(path)
    raw = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": [hf_class], "model_type": model_type}))
    return tmp_path


@pytest.mark.engine
def test_an_architecture_registered_in_one_entry_loads_and_runs_its_class(checkpoint, tmp_path, fake_registered):
    model_dir = _renamed(checkpoint, tmp_path, "FakeForCausalLM", "fake")
    config = load_model_config(model_dir)
    assert config.architecture == "fake"
    backend = make_attention_backend("torch", CPU)
    model = load_model(model_dir, config, backend, torch.float32, CPU)
    reference = load_model(checkpoint, load_model_config(checkpoint), backend, torch.float32, CPU)
    assert type(model) is FakeForCausalLM and type(reference) is LlamaForCausalLM
    for (name, mine), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(mine, theirs), name


@pytest.mark.fast
def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}))
    with pytest.raises(ValueError, match=r"architectures=\['GemmaForCausalLM'\] model_type='gemma' is not supported"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="architecture 'gemma' is not supported"):
        registry.architecture("gemma")


@pytest.mark.fast
def test_a_name_or_class_already_registered_is_refused():
    with pytest.raises(ValueError, match="registered already"):
        registry.register(dataclasses.replace(FAKE, hf_classes=("LlamaForCausalLM",)))
    with pytest.raises(ValueError, match="registered already"):
        registry.register(dataclasses.replace(FAKE, name="llama"))


@pytest.mark.fast
def test_the_built_in_families_are_entries_sharing_llamas_decoder():
    names = {entry.name: entry for entry in registry.architectures()}
    assert set(names) >= {"llama", "mistral", "qwen2"}
    # Phi-3's fused tensors are its weight map's, its window (Mistral's too) Llama's decoder's window_options.
    assert {names[n].model_class for n in ("llama", "mistral", "qwen2", "phi3")} == {LlamaForCausalLM}
    assert registry.gguf_architecture("llama") is names["llama"]
    assert registry.gguf_architecture("qwen2") is names["qwen2"]
    # llama.cpp interleaves the Q/K rows of NORM-rope families only (test_gguf_families shows Qwen's files read).
    assert names["llama"].gguf.qk_interleaved and not names["qwen2"].gguf.qk_interleaved


@pytest.mark.fast
def test_the_newer_families_are_entries_with_their_own_model_classes():
    names = {entry.name: entry for entry in registry.architectures()}
    newer = {"qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text", "phi3"}
    assert set(names) >= newer
    assert all(names[name].model_class is not LlamaForCausalLM for name in newer - {"phi3"})
    assert {cls for name in newer for cls in names[name].hf_classes} == {
        "Qwen3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
        "Phi3ForCausalLM",
    }  # fmt: skip
    # Their GGUF files (test_gguf_families.py): Mixtral says "llama" and is told apart by its merged experts.
    gguf_files = {("qwen3", False): "qwen3", ("qwen3moe", True): "qwen3_moe", ("gemma2", False): "gemma2",
                  ("gemma3", False): "gemma3_text", ("llama", True): "mixtral", ("llama", False): "llama",
                  ("phi3", False): "phi3"}  # fmt: skip
    for (gguf_name, experts), name in gguf_files.items():
        assert registry.gguf_architecture(gguf_name, experts) is names[name]
    assert names["mixtral"].gguf.qk_interleaved and names["phi3"].gguf.partial_rotary


@pytest.mark.fast
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.12.self_attn.q_proj.weight", (12, "self_attn.q_proj", "weight")),
        ("model.layers.0.mlp.down_proj.bias", (0, "mlp.down_proj", "bias")),
        ("model.embed_tokens.weight", (None, "model.embed_tokens", "weight")),
        ("lm_head.weight", (None, "lm_head", "weight")),
    ],
)
def test_tensor_names_split_into_layer_module_and_kind(name, expected):
    assert split_tensor_name(name) == expected


@pytest.mark.fast
def test_under_tensor_parallelism_an_unlisted_tensor_is_an_error_naming_it():
    config = SimpleNamespace(architecture="llama", tie_word_embeddings=False)
    shards = CheckpointShards(config, TensorParallel(0, 2), llama.TP_SPLITS)
    expert = "model.layers.0.block_sparse_moe.experts.3.w1.weight"  # a Mixture-of-Experts tensor Llama has not
    part = SimpleNamespace(get_shape=lambda: [64, 32])
    with pytest.raises(ValueError, match=rf"{expert!r} is not in llama's tensor-parallel split table"):
        shards.read(expert, part)


@pytest.mark.engine
@pytest.mark.parametrize("architecture", ["llama", "mistral", "qwen2"])
def test_every_tensor_of_a_checkpoint_is_in_its_split_table(checkpoint, architecture):
    """Llama's checkpoint tensors (the other two families name theirs alike), the norms listed as replicated."""
    splits = registry.architecture(architecture).tp_splits
    names = [name for path in safetensors_files(checkpoint) for name in safe_open(str(path), "pt").keys()]  # noqa: SIM118
    assert names
    assert [name for name in names if split_tensor_name(name)[1] not in splits] == []
