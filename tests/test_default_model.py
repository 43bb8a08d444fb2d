"""tokend-tiny-random, the built-in model of tests and benchmarks: made on first use, deterministic, a real Llama
that transformers agrees with. (The real default, SmolLM2-135M-Instruct: test_default_model_real.py.)"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from conftest import random_prompts, transformers_greedy

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME, ensure_tiny_random_model
from gpu_runtime.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_written_once_into_the_cache_dir_with_the_same_weights_every_time(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKEND_CACHE_DIR", str(tmp_path / "a"))
    first = ensure_tiny_random_model()
    assert first.is_relative_to(tmp_path / "a")
    assert {p.name for p in first.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    monkeypatch.setenv("TOKEND_CACHE_DIR", str(tmp_path / "b"))
    second = ensure_tiny_random_model()
    digest = [hashlib.sha256((d / "model.safetensors").read_bytes()).hexdigest() for d in (first, second)]
    assert digest[0] == digest[1]


def test_llm_serves_it_by_name_and_matches_transformers():
    llm = LLM(TINY_RANDOM_MODEL_NAME)
    assert llm.engine.model_name == TINY_RANDOM_MODEL_NAME
    prompts = random_prompts(4, 1, 40, seed=7)
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(ensure_tiny_random_model(), prompts, 16)


def test_byte_level_tokenizer_round_trips_any_text():
    tokenizer = Tokenizer(ensure_tiny_random_model())
    text = "tokend ✓ — naïve 日本語 🙂\n\ttabs"
    ids = tokenizer.encode(text)
    assert ids[0] == 256  # begin-of-text
    assert len(ids) == 1 + len(text.encode())
    assert tokenizer.decode(ids) == text


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )


def test_cli_generate_prints_a_completion_per_prompt():
    model = ("--model", TINY_RANDOM_MODEL_NAME)
    result = _cli("generate", "--offline", *model, "Hello", "Second prompt", "--max-tokens", "5")
    assert result.returncode == 0, result.stderr
    assert TINY_RANDOM_MODEL_NAME in result.stdout
    assert result.stdout.count("finish_reason=length") == 2
    assert "10 tokens in" in result.stdout


def test_cli_bad_value_names_the_field_without_a_traceback():
    result = _cli("generate", "--offline", "--model", TINY_RANDOM_MODEL_NAME, "Hello", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr
