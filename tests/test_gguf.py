"""GGUF checkpoints: each dequantizer agrees bit for bit with the `gguf` package's own, and a GGUF file written the
way llama.cpp's converter writes one (its tensor names, its Q/K row order) serves exactly the model it came from.

The real model (SmolLM2-135M-Instruct, against transformers) is test_default_model_real.py's."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.default_model import ensure_tiny_random_model, resolve_model_dir, served_name
from gpu_runtime.gguf.convert import converted_dir, ensure_converted
from gpu_runtime.gguf.dequantize import SUPPORTED_TYPES, UnsupportedTensorType, dequantize
from gpu_runtime.gguf.model_config import _llama3_factors, llama3_rope_scaling
from gpu_runtime.tokenizer import Tokenizer

Q = GGMLQuantizationType
# k-quants: gguf has no quantizer for them, so their blocks are random bytes with sane scales.
_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_tensor(tensor_type: GGMLQuantizationType, rows: int, rng: np.random.Generator) -> np.ndarray:
    """A (rows, bytes) tensor of `tensor_type` as a GGUF file stores it, made by gguf's own quantizer if it has one."""
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    values = rng.normal(scale=2.0, size=(rows, 4 * max(block_size, 32))).astype(np.float32)
    if tensor_type in _SCALE_OFFSETS:
        raw = rng.integers(0, 256, size=(rows, values.shape[1] // block_size * type_size), dtype=np.uint8)
        blocks = raw.reshape(-1, type_size)
        for offset in _SCALE_OFFSETS[tensor_type]:  # an f16 scale: random bytes could spell inf or NaN
            blocks[:, offset : offset + 2] = rng.normal(0, 0.05, (len(blocks), 1)).astype(np.float16).view(np.uint8)
        return raw
    if tensor_type is Q.BF16:
        from gguf.quants import BF16

        return BF16.quantize(values)
    return gguf_quantize(values, tensor_type)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_each_dequantizer_equals_ggufs_own_bit_for_bit(type_name):
    tensor_type = Q[type_name]
    raw = _random_tensor(tensor_type, rows=16, rng=np.random.default_rng(len(type_name)))
    expected = gguf_dequantize(raw, tensor_type).astype(np.float32)
    ours = dequantize(raw, tensor_type, expected.shape, "blk.0.attn_q.weight").float().numpy()
    assert ours.shape == expected.shape
    assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32))


def test_a_type_it_cannot_read_is_refused_by_name():
    raw = np.zeros((2, GGML_QUANT_SIZES[Q.Q3_K][1]), dtype=np.uint8)
    with pytest.raises(UnsupportedTensorType, match=r"'blk\.7\.ffn_up\.weight' is stored as Q3_K.*Q4_K"):
        dequantize(raw, Q.Q3_K, (2, 256), "blk.7.ffn_up.weight")


def test_llama3_rope_scaling_is_recognised_from_llama_cpps_rope_freqs():
    standard = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = torch.tensor(_llama3_factors(500000.0, 128, standard), dtype=torch.float32)
    assert llama3_rope_scaling(factors, 500000.0, 128) == {"rope_type": "llama3", **standard}
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_rope_scaling(factors * 1.5, 500000.0, 128)


# -- a GGUF of the tiny model, written as llama.cpp's converter writes one ------------------------------------------


def _llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows interleaved for ggml's rotary embedding."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path, tensor_type: GGMLQuantizationType = Q.F32, arch: str = "llama", pre: str = "default") -> None:
    """tokend-tiny-random as a GGUF file, every 2-D weight stored as `tensor_type`."""
    source = ensure_tiny_random_model()
    config = json.loads((source / "config.json").read_text())
    tokenizer = Tokenizer(source).backend
    vocab = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    specials = {"<|begin_of_text|>", "<|end_of_text|>"}
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in specials else 1 for token, _ in vocab])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_array("tokend.test.nested", [[1, 2], [3]])  # read by no one: the header walk decodes it all the same
    writer.add_bool("tokend.test.flag", True)
    writer.add_array("tokend.test.scores", [0.5, -1.25])
    weights = load_file(str(source / "model.safetensors"))
    for name, tensor in weights.items():
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.removesuffix(".weight")
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
            if module == "self_attn.q_proj":
                tensor = _llama_cpp_permute(tensor, config["num_attention_heads"])
            elif module == "self_attn.k_proj":
                tensor = _llama_cpp_permute(tensor, config["num_key_value_heads"])
        array = tensor.numpy()
        if array.ndim == 2 and tensor_type is not Q.F32:
            writer.add_tensor(gguf_name, gguf_quantize(array, tensor_type), raw_dtype=tensor_type)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.mark.parametrize("tensor_type", [Q.F32, Q.F16, Q.Q8_0])
def test_the_header_walk_reads_what_ggufs_own_reader_reads(tmp_path, tensor_type):
    """read_gguf's metadata and tensor views (from layout_check's walk) equal gguf.GGUFReader's, value for value:
    strings, string and number arrays, booleans, and float and quantized tensors; a nested array keeps its nesting
    (gguf's contents() flattens it)."""
    from gguf import GGUFReader

    from gpu_runtime.gguf.reader import read_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, tensor_type)
    ours, theirs = read_gguf(path), GGUFReader(path)
    assert ours.metadata.pop("tokend.test.nested") == [[1, 2], [3]]
    assert ours.metadata == {name: field.contents() for name, field in theirs.fields.items() if "nested" not in name}
    facts = ("name", "tensor_type", "n_elements", "n_bytes", "data_offset")
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert [getattr(mine, fact) for fact in facts] == [getattr(reference, fact) for fact in facts]
        assert mine.shape.tolist() == reference.shape.tolist() and mine.data.dtype == reference.data.dtype
        assert np.array_equal(mine.data, reference.data)


def test_the_conversion_is_the_checkpoint_the_gguf_was_made_from(tiny_gguf):
    converted = ensure_converted(tiny_gguf)
    source = ensure_tiny_random_model()
    assert load_file(str(converted / "model.safetensors")).keys() == load_file(str(source / "model.safetensors")).keys()
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        assert torch.equal(load_file(str(converted / "model.safetensors"))[name], tensor), name
    config = json.loads((converted / "config.json").read_text())
    expected = json.loads((source / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rope_theta"):
        assert config[key] == expected[key], key
    assert config["tie_word_embeddings"] is True


def test_a_gguf_file_serves_the_same_tokens_and_text_as_its_source(tiny_gguf):
    prompts = ["Hello, world", "naïve café 🙂 日本", "def f(x):\n    return x"]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    from_gguf = LLM(str(tiny_gguf), kv_cache_bytes=8 << 20)
    original = LLM("tokend-tiny-random", kv_cache_bytes=8 << 20)
    assert from_gguf.engine.model_name == "tiny"
    for ours, theirs in zip(from_gguf.generate(prompts, greedy), original.generate(prompts, greedy), strict=True):
        assert ours.prompt_token_ids == theirs.prompt_token_ids  # the rebuilt tokenizer, BOS included
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids


def test_a_directory_holding_one_gguf_names_it_and_one_holding_two_is_refused(tiny_gguf, tmp_path):
    (tmp_path / "one").mkdir()
    os.link(tiny_gguf, tmp_path / "one" / "model.gguf")
    assert resolve_model_dir(str(tmp_path / "one")) == converted_dir(tmp_path / "one" / "model.gguf")
    assert served_name(str(tmp_path / "one" / "model.gguf")) == "model"
    os.link(tiny_gguf, tmp_path / "one" / "other.gguf")
    with pytest.raises(ValueError, match="several GGUF files"):
        resolve_model_dir(str(tmp_path / "one"))


def test_converted_once_then_reused_and_converted_anew_when_the_file_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = ensure_converted(path)
    written = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(path) == first and (first / "model.safetensors").stat().st_mtime_ns == written
    # This file's scratch directories only: the cache is shared with other tests' conversions, running beside it.
    assert not list(first.parent.glob(f".writing-{first.name}-*")), "no scratch directory is left behind"
    write_tiny_gguf(path, tensor_type=Q.Q8_0)  # replaced: another size (and modification time)
    second = ensure_converted(path)
    assert second != first
    quantized = load_file(str(second / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    original = load_file(str(first / "model.safetensors"))["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(quantized, original) and torch.allclose(quantized, original, atol=2e-3)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [({"arch": "falcon"}, "architecture 'falcon'"), ({"pre": "no-such-split"}, "pre-tokenizer 'no-such-split'")],
)
def test_an_unsupported_architecture_or_tokenizer_is_refused_by_name(tmp_path, options, refusal):
    path = tmp_path / "other.gguf"
    write_tiny_gguf(path, **options)
    with pytest.raises(ValueError, match=refusal):
        ensure_converted(path)
    target = converted_dir(path)
    assert not target.exists() and not list(target.parent.glob(f".writing-{target.name}-*"))


def test_serve_takes_a_built_in_name_or_a_gguf_file_and_refuses_anything_else(tiny_gguf):
    from daemon.cli import build_parser
    from daemon.config import load_serve_config

    def served(*argv: str) -> list[tuple[str, str | None]]:
        config = load_serve_config(build_parser().parse_args(["serve", *argv]), environ={})
        return [(model.name, model.path) for model in config.served_models()]

    assert served() == [("SmolLM2-135M-Instruct", None)]
    assert served("--model", "tokend-tiny-random") == [("tokend-tiny-random", "tokend-tiny-random")]
    assert served("--model", str(tiny_gguf)) == [("tiny", str(tiny_gguf))]
    assert served("--model", str(tiny_gguf.parent)) == [(tiny_gguf.parent.name, str(tiny_gguf.parent))]
    with pytest.raises(ValueError, match=r"^model: must be .*\.gguf file.*tokend-tiny-random, got '/no/such\.gguf'"):
        served("--model", "/no/such.gguf")
