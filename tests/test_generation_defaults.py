"""generation_config.json's sampling defaults, as vLLM's --generation-config reads them: applied to the fields a
request leaves unset, overridden by the ones it sets, ignored with `vllm`."""

from __future__ import annotations

import json
import shutil

import pytest

from frontend.errors import RequestError
from frontend.validation import prepare
from gpu_runtime import LLM, EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.generation_defaults import load_sampling_defaults
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.ipc.sampling_params import SamplingDefaults
from tokend.v1 import tokend_pb2 as pb

# What a chat model's generation_config.json typically holds, sampling defaults among other keys.
GENERATION_CONFIG = {
    "bos_token_id": 256,
    "eos_token_id": 257,
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.05,
    "min_p": None,  # null: not set
    "max_new_tokens": 512,  # vLLM caps max_tokens with it; tokend does not take it (see generation_defaults)
}
DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.05)


def with_generation_config(directory, config: dict):
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_auto_takes_the_five_sampling_fields_the_file_sets(tmp_path):
    with_generation_config(tmp_path, GENERATION_CONFIG)
    assert load_sampling_defaults(tmp_path, "auto") == DEFAULTS
    assert DEFAULTS.as_dict() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}


def test_auto_without_a_file_or_sampling_keys_has_no_defaults(tmp_path):
    assert load_sampling_defaults(tmp_path, "auto") == SamplingDefaults()
    with_generation_config(tmp_path, {"bos_token_id": 1, "eos_token_id": 2})
    assert load_sampling_defaults(tmp_path, "auto").as_dict() == {}


def test_vllm_ignores_the_file(tmp_path):
    with_generation_config(tmp_path, GENERATION_CONFIG)
    assert load_sampling_defaults(tmp_path, "vllm") == SamplingDefaults()


def test_a_directory_reads_its_own_file_and_must_have_one(tmp_path):
    model_dir, other = tmp_path / "model", tmp_path / "other"
    model_dir.mkdir()
    other.mkdir()
    with_generation_config(other, {"temperature": 0.3})
    assert load_sampling_defaults(model_dir, str(other)) == SamplingDefaults(temperature=0.3)
    with pytest.raises(ValueError, match=r"^generation_config: .*model has no generation_config.json"):
        load_sampling_defaults(other, str(model_dir))


@pytest.mark.parametrize(
    ("config", "field"),
    [({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"repetition_penalty": 0}, "repetition_penalty")],
)
def test_a_value_no_request_could_send_fails_naming_the_file_and_the_way_out(tmp_path, config, field):
    with_generation_config(tmp_path, config)
    with pytest.raises(ValueError, match=rf"generation_config.json: {field}: .*--generation-config vllm"):
        load_sampling_defaults(tmp_path, "auto")


def test_a_broken_file_fails_naming_it(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"generation_config.json: not readable JSON"):
        load_sampling_defaults(tmp_path, "auto")


# -- the frontend fills them in -------------------------------------------------------------------------------


def ready(defaults: SamplingDefaults) -> SchedulerReady:
    return SchedulerReady("m/0", "1", 1, "m", "/m", "0", 2048, 258, 1000, 16, 8, b"", sampling_defaults=defaults)


def prepared(sampling: pb.SamplingParams, defaults: SamplingDefaults = DEFAULTS) -> SamplingParams:
    return prepare(pb.GenerateRequest(prompt="x", sampling=sampling), ready(defaults), [1, 2, 3]).sampling


def test_unset_fields_take_the_models_defaults():
    params = prepared(pb.SamplingParams(max_tokens=4))
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.6, 0.9, 20, 1.05)
    assert params.min_p == 0.0 and params.max_tokens == 4


def test_set_fields_override_the_models_defaults_even_with_the_neutral_value():
    wire = pb.SamplingParams(temperature=0, top_p=1, top_k=0, repetition_penalty=1, min_p=0.25)
    params = prepared(wire)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0, 1, 0, 1)
    assert params.min_p == 0.25
    assert prepared(pb.SamplingParams(temperature=1.5)).top_k == 20  # the others still come from the model


def test_without_defaults_unset_fields_keep_samplingparams_own():
    assert prepared(pb.SamplingParams(), SamplingDefaults()) == SamplingParams()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (pb.SamplingParams(presence_penalty=2.5), r"^sampling.presence_penalty: must be in \[-2, 2\]"),
        (pb.SamplingParams(frequency_penalty=-3), r"^sampling.frequency_penalty: must be in \[-2, 2\]"),
        (pb.SamplingParams(repetition_penalty=0), r"^sampling.repetition_penalty: must be a number > 0"),
        (pb.SamplingParams(logit_bias={5: 150}), r"^sampling.logit_bias: the bias of token 5 must be in \[-100, 100\]"),
        (pb.SamplingParams(logit_bias={258: 1}), r"^sampling.logit_bias: token id 258 is outside the vocabulary"),
        (pb.SamplingParams(logit_bias={i: 1 for i in range(301)}), r"^sampling.logit_bias: at most 300 tokens"),
    ],
)
def test_each_control_out_of_range_is_refused_naming_it(sampling, message):
    with pytest.raises(RequestError, match=message):
        prepared(sampling)


# -- the engine reads them; the offline API uses them as vLLM's LLM does --------------------------------------


@pytest.fixture(scope="module")
def tuned_dir(llama_dir, tmp_path_factory):
    """The llama checkpoint with greedy and a repetition penalty as its recommended sampling."""
    directory = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(llama_dir, directory)
    config = json.loads((llama_dir / "generation_config.json").read_text())
    return with_generation_config(directory, {**config, "temperature": 0.0, "repetition_penalty": 1.5})


def test_the_engine_reads_the_checkpoints_defaults_unless_told_not_to(tuned_dir):
    engine = LLMEngine(EngineConfig(model=str(tuned_dir)))
    assert engine.sampling_defaults == SamplingDefaults(temperature=0.0, repetition_penalty=1.5)
    engine = LLMEngine(EngineConfig(model=str(tuned_dir), generation_config="vllm"))
    assert engine.sampling_defaults == SamplingDefaults()


def test_a_bad_default_fails_the_models_start(tuned_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tuned_dir, broken)
    with_generation_config(broken, {"top_k": -5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_k: must be an integer >= 0"):
        LLMEngine(EngineConfig(model=str(broken)))


def test_offline_generate_without_params_uses_the_models_defaults(tuned_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7]}, {"prompt_token_ids": [100, 3]}]
    outputs = LLM(str(tuned_dir)).generate(prompts)
    explicit = LLM(str(tuned_dir), generation_config="vllm").generate(
        prompts, SamplingParams(temperature=0, repetition_penalty=1.5)
    )
    plain = LLM(str(tuned_dir), generation_config="vllm").generate(prompts, SamplingParams(temperature=0))
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert tokens == [o.outputs[0].token_ids for o in explicit]
    assert tokens != [o.outputs[0].token_ids for o in plain]
