"""load_model_config on hand-written config.json variants, and RoPE frequencies against transformers."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_runtime.model.config import RopeConfig, load_model_config
from gpu_runtime.model.rope import inverse_frequencies

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_DROP = object()  # an override that removes the key


def write(tmp_path, config=None, generation=None, **overrides):
    raw = {**BASE, **(config or {}), **overrides}
    raw = {k: v for k, v in raw.items() if v is not _DROP}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


# -- shapes -----------------------------------------------------------------------------------------


def test_llama_shape_fields(tmp_path):
    cfg = load_model_config(write(tmp_path))
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (1000, 256, 512, 3)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (8, 2, 32)
    assert cfg.rms_norm_eps == 1e-5
    assert cfg.max_model_len == 4096
    assert cfg.eos_token_ids == (2,)
    assert cfg.bos_token_id == 1
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.tie_word_embeddings)
    assert cfg.kv_elements_per_token == 2 * 3 * 2 * 32
    assert cfg.rope == RopeConfig(theta=10000.0)


def test_explicit_head_dim_and_missing_kv_heads(tmp_path):
    cfg = load_model_config(write(tmp_path, head_dim=64, num_key_value_heads=_DROP))
    assert cfg.head_dim == 64  # not hidden_size // num_heads = 32
    assert cfg.num_kv_heads == 8  # no GQA field: one KV head per query head


def test_model_type_alone_identifies_the_architecture(tmp_path):
    cfg = load_model_config(write(tmp_path, architectures=_DROP, model_type="qwen2"))
    assert cfg.architecture == "qwen2"


def test_llama_attention_bias_covers_o_proj(tmp_path):
    cfg = load_model_config(write(tmp_path, attention_bias=True, mlp_bias=True, tie_word_embeddings=True))
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias and cfg.tie_word_embeddings


def test_qwen2_gets_qkv_bias_but_no_o_bias(tmp_path):
    cfg = load_model_config(
        write(
            tmp_path,
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            sliding_window=128,  # present in Qwen2 configs but off unless use_sliding_window
            use_sliding_window=False,
        )
    )
    assert cfg.architecture == "qwen2"
    assert cfg.qkv_bias is True
    assert cfg.o_bias is False
    assert cfg.max_model_len == 4096


def test_qwen2_with_sliding_window_on_is_capped(tmp_path):
    cfg = load_model_config(
        write(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=1024, use_sliding_window=True)
    )
    assert cfg.max_model_len == 1024


def test_mistral_keeps_its_context_and_windows_every_layer(tmp_path):
    cfg = load_model_config(
        write(
            tmp_path,
            architectures=["MistralForCausalLM"],
            model_type="mistral",
            max_position_embeddings=32768,
            sliding_window=4096,
        )
    )
    assert cfg.architecture == "mistral"
    assert (cfg.max_model_len, cfg.sliding_window, cfg.layer_types) == (32768, 4096, ())


@pytest.mark.parametrize("window", [None, 65536])
def test_mistral_without_a_binding_window_keeps_max_position_embeddings(tmp_path, window):
    cfg = load_model_config(
        write(tmp_path, architectures=["MistralForCausalLM"], max_position_embeddings=32768, sliding_window=window)
    )
    assert cfg.max_model_len == 32768


def test_llama_ignores_sliding_window_unless_enabled(tmp_path):
    cfg = load_model_config(write(tmp_path, sliding_window=512))
    assert cfg.max_model_len == 4096


# -- rope -------------------------------------------------------------------------------------------

LLAMA3_PARAMS = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_transformers5_rope_parameters_default(tmp_path):
    cfg = load_model_config(write(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert cfg.rope == RopeConfig(theta=500000.0)


def test_transformers5_rope_parameters_llama3(tmp_path):
    params = {**LLAMA3_PARAMS, "rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 2.0}
    cfg = load_model_config(write(tmp_path, rope_parameters=params))
    assert cfg.rope == RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=2.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def test_old_style_rope_theta_and_rope_scaling_llama3(tmp_path):
    scaling = {**LLAMA3_PARAMS, "rope_type": "llama3", "factor": 32.0, "original_max_position_embeddings": 4096}
    cfg = load_model_config(write(tmp_path, rope_theta=250000.0, rope_scaling=scaling))
    assert cfg.rope == RopeConfig(
        theta=250000.0,
        rope_type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=4096,
    )


def test_old_style_rope_scaling_with_legacy_type_key(tmp_path):
    cfg = load_model_config(write(tmp_path, rope_theta=500000.0, rope_scaling={**LLAMA3_PARAMS, "type": "llama3"}))
    assert cfg.rope.rope_type == "llama3"
    assert cfg.rope.theta == 500000.0


def test_old_style_rope_theta_without_scaling(tmp_path):
    cfg = load_model_config(write(tmp_path, rope_theta=1234.5, rope_scaling=None))
    assert cfg.rope == RopeConfig(theta=1234.5)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type_raises_naming_the_key(tmp_path, rope_type, style):
    with pytest.raises(ValueError, match=rf"rope_type.*{rope_type}"):
        load_model_config(write(tmp_path, **{style: {"rope_type": rope_type, "factor": 2.0, "rope_theta": 1e4}}))


# -- rejections -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("architectures", "model_type"),
    [(["GPT2LMHeadModel"], "gpt2"), (["DeepseekV3ForCausalLM"], "deepseek_v3"), (None, None), ([], "gemma")],
)
def test_unsupported_architecture_raises_naming_the_key(tmp_path, architectures, model_type):
    with pytest.raises(ValueError, match=r"architectures=") as info:
        load_model_config(write(tmp_path, architectures=architectures, model_type=model_type))
    assert "not supported" in str(info.value)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_unsupported_hidden_act_raises_naming_the_key(tmp_path, act):
    with pytest.raises(ValueError, match=rf"hidden_act='{act}'"):
        load_model_config(write(tmp_path, hidden_act=act))


def test_missing_config_json_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(tmp_path)


def test_missing_directory_raises(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_model_config(tmp_path / "does-not-exist")


# -- eos --------------------------------------------------------------------------------------------


def test_generation_config_eos_list_overrides_config_eos(tmp_path):
    cfg = load_model_config(write(tmp_path, generation={"eos_token_id": [128001, 128008, 128009]}))
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_generation_config_single_eos_overrides_config_eos(tmp_path):
    cfg = load_model_config(write(tmp_path, eos_token_id=[2, 3], generation={"eos_token_id": 7}))
    assert cfg.eos_token_ids == (7,)


def test_generation_config_without_eos_falls_back_to_config(tmp_path):
    cfg = load_model_config(write(tmp_path, eos_token_id=[5, 6], generation={"bos_token_id": 1}))
    assert cfg.eos_token_ids == (5, 6)


def test_no_eos_anywhere(tmp_path):
    cfg = load_model_config(write(tmp_path, eos_token_id=_DROP))
    assert cfg.eos_token_ids == ()


# -- inverse frequencies vs transformers -----------------------------------------------------------


def _hf_inverse_frequencies(theta: float, head_dim: int, rope_parameters: dict) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=131072,
        rope_parameters={**rope_parameters, "rope_theta": theta},
    )
    rope_type = config.rope_parameters["rope_type"]
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    assert scaling == 1.0  # tokend never scales cos/sin, so transformers must not either
    return inv_freq


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_default_inverse_frequencies_match_transformers(tmp_path, head_dim, theta):
    ours = inverse_frequencies(RopeConfig(theta=theta), head_dim)
    theirs = _hf_inverse_frequencies(theta, head_dim, {"rope_type": "default"})
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    ("head_dim", "theta", "params"),
    [
        (128, 500000.0, LLAMA3_PARAMS),  # Llama 3.1
        (64, 500000.0, {**LLAMA3_PARAMS, "factor": 32.0, "original_max_position_embeddings": 8192}),  # Llama 3.2
        (16, 10000.0, {**LLAMA3_PARAMS, "original_max_position_embeddings": 64}),  # the test checkpoints' setting
        (
            32,
            10000.0,
            {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0, "original_max_position_embeddings": 256},
        ),
    ],
)
def test_llama3_inverse_frequencies_match_transformers(tmp_path, head_dim, theta, params):
    # Parse the config as tokend does, so a dropped or misread field shows up as a mismatch.
    cfg = load_model_config(
        write(
            tmp_path,
            hidden_size=head_dim * 4,
            num_attention_heads=4,
            head_dim=head_dim,
            rope_parameters={**params, "rope_type": "llama3", "rope_theta": theta},
        )
    )
    ours = inverse_frequencies(cfg.rope, cfg.head_dim)
    theirs = _hf_inverse_frequencies(theta, head_dim, {**params, "rope_type": "llama3"})
    assert torch.equal(ours, theirs)
    # The case must exercise scaling at all: some frequencies are changed by it.
    unscaled = inverse_frequencies(RopeConfig(theta=theta), head_dim)
    assert not torch.equal(ours, unscaled)


def test_llama3_scaling_covers_all_three_bands():
    """Short wavelengths kept, long ones divided by `factor`, the band between interpolated."""
    rope = RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0, original_max_position_embeddings=64)
    base = inverse_frequencies(RopeConfig(theta=10000.0), 16)
    scaled = inverse_frequencies(rope, 16)
    ratio = base / scaled
    assert torch.any(ratio == 1.0)
    assert torch.any(ratio == 8.0)
    assert torch.any((ratio > 1.0) & (ratio < 8.0))
    assert torch.all(scaled <= base)
