"""The sampling controls through a real daemon: each OpenAI field reaches the engine from the gateway and from
gRPC, and a checkpoint's generation_config.json defaults apply to what a request leaves unset."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from daemon_harness import Daemon

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME, resolve_model_dir
from gpu_runtime.tokenizer import Tokenizer
from tokend.v1 import tokend_pb2 as pb

PROMPT = "HelloHello"
NUM_TOKENS = 16
TUNED = "tuned"  # the same tiny model, whose generation_config.json recommends greedy with a repetition penalty
TUNED_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.8}


@pytest.fixture(scope="module")
def tuned_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(resolve_model_dir(TINY_RANDOM_MODEL_NAME), directory)
    config = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**config, **TUNED_DEFAULTS}))
    return directory


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tuned_dir):
    config = tmp_path_factory.mktemp("config") / "tokend.toml"
    config.write_text(
        f'[[models]]\nname = "{TINY_RANDOM_MODEL_NAME}"\npath = "{TINY_RANDOM_MODEL_NAME}"\n\n'
        f'[[models]]\nname = "{TUNED}"\npath = "{tuned_dir}"\n'
    )
    with Daemon("--config", str(config)) as running:
        yield running


@pytest.fixture(scope="module")
def offline():
    """The same model in this process, without generation_config defaults: the expected outputs."""
    return LLM(TINY_RANDOM_MODEL_NAME, generation_config="vllm")


def expected_text(llm: LLM, **controls) -> str:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, **{"temperature": 0, **controls})
    return llm.generate(PROMPT, params)[0].outputs[0].text


def greedy_tokens(llm: LLM) -> list[int]:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
    return llm.generate(PROMPT, params)[0].outputs[0].token_ids


def token_id(text: str) -> int:
    (token,) = Tokenizer(resolve_model_dir(TINY_RANDOM_MODEL_NAME)).encode(text, add_special_tokens=False)
    return token


def completion(daemon: Daemon, model: str = TINY_RANDOM_MODEL_NAME, **fields) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NUM_TOKENS, "ignore_eos": True, **fields}
    reply = httpx.post(f"{daemon.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_logit_bias_100_forces_its_token_at_temperature_0(daemon):
    assert completion(daemon, temperature=0, logit_bias={str(token_id("Q")): 100}) == "Q" * NUM_TOKENS


@pytest.mark.parametrize(
    "controls",
    [
        {"repetition_penalty": 1.8},
        {"presence_penalty": 2.0},
        {"frequency_penalty": 1.5},
        {"logit_bias": "bans greedy's first token"},
        {"presence_penalty": -1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    ],
    ids=lambda controls: ",".join(controls),
)
def test_each_control_reaches_the_engine_through_the_gateway(daemon, offline, controls):
    engine_controls = dict(controls)
    if "logit_bias" in controls:  # token ids are known only once the model is written
        engine_controls["logit_bias"] = {greedy_tokens(offline)[0]: -100, token_id("e"): -100}
        controls = {"logit_bias": {str(token): bias for token, bias in engine_controls["logit_bias"].items()}}
    text = completion(daemon, temperature=0, **controls)
    assert text == expected_text(offline, **engine_controls)
    assert text != expected_text(offline)  # the control changed the output: it was not dropped on the way


def test_chat_completions_take_the_controls_too(daemon):
    body = {
        "model": TINY_RANDOM_MODEL_NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "logit_bias": {str(token_id("Q")): 100},
    }
    reply = httpx.post(f"{daemon.http_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Q" * 8


def test_grpc_takes_the_same_controls(daemon, offline):
    request = pb.GenerateRequest(
        model=TINY_RANDOM_MODEL_NAME,
        prompt=PROMPT,
        sampling=pb.SamplingParams(
            max_tokens=NUM_TOKENS,
            temperature=0,
            ignore_eos=True,
            frequency_penalty=1.5,
            logit_bias={token_id("H"): -100},
        ),
    )
    text = "".join(chunk.text for chunk in daemon.generation.Generate(request, timeout=60))
    assert text == expected_text(offline, frequency_penalty=1.5, logit_bias={token_id("H"): -100})
    assert text != expected_text(offline)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"min_tokens": 4}, "min_tokens"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"guided_choice": []}, "guided_choice"),
    ],
    ids=lambda value: json.dumps(value)[:40] if isinstance(value, dict) else value,
)
def test_a_bad_or_unsupported_control_is_a_400_naming_it(daemon, fields, param):
    body = {"model": TINY_RANDOM_MODEL_NAME, "prompt": "Hi", "max_tokens": 2, **fields}
    reply = httpx.post(f"{daemon.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and param in error["message"], error


def test_a_models_generation_config_fills_unset_fields_and_a_request_overrides_them(daemon, tuned_dir):
    tuned = LLM(str(tuned_dir), generation_config="vllm")
    with_defaults = expected_text(tuned, **TUNED_DEFAULTS)
    # No temperature and no repetition_penalty: the model's greedy with its penalty.
    assert completion(daemon, model=TUNED) == with_defaults
    # Each field the request sets wins over the model's, even when it is the neutral value.
    assert completion(daemon, model=TUNED, repetition_penalty=1.0) == expected_text(tuned)
    assert completion(daemon, model=TUNED, repetition_penalty=1.2) == expected_text(tuned, repetition_penalty=1.2)
    assert expected_text(tuned) != with_defaults
    # The model without sampling defaults in its generation_config.json samples at temperature 1: not greedy.
    seeded = completion(daemon, seed=3)
    assert seeded == completion(daemon, seed=3) != completion(daemon, temperature=0)
