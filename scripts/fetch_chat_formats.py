"""Fetches the real chat templates and tokenizers the tool-call format tests render and tokenize calls with.

llama.cpp keeps copies of the families' published chat templates (models/templates/) and vocabulary-only GGUF files
(models/ggml-vocab-*.gguf); the llama-cpp-python source package vendors both, so they come from PyPI like every
other dependency. Only the few files the tests use are kept, in the virtualenv: <venv>/share/tokend/chat-formats,
each vocabulary also rebuilt once as a tokenizer.json by tokend's GGUF tokenizer reader (reading a 150k-token GGUF's
metadata with the `gguf` package takes seconds). Mistral's tokenizer comes from `mistral-common` (a dev dependency).

Usage: python scripts/fetch_chat_formats.py   (a no-op when the files are there)
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gpu_runtime.gguf.reader import read_gguf
from gpu_runtime.gguf.tokenizer import build_tokenizer

PACKAGE = "llama-cpp-python==0.3.36"
MODELS = "vendor/llama.cpp/models/"
FILES = (
    "templates/Qwen-Qwen2.5-7B-Instruct.jinja",
    "templates/meta-llama-Llama-3.1-8B-Instruct.jinja",
    "templates/mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "ggml-vocab-qwen2.gguf",  # Qwen2's byte-level BPE (Qwen2.5 adds <tool_call> as a token on top of it)
    "ggml-vocab-llama-bpe.gguf",  # Llama 3's (3.1 renames reserved special tokens only)
)


def formats_dir() -> Path:
    return Path(sys.prefix) / "share" / "tokend" / "chat-formats"


def fetch(target: Path) -> None:
    if not all((target / Path(name).name).is_file() for name in FILES):
        _extract(target)
    for vocabulary in target.glob("*.gguf"):
        rebuilt = vocabulary.with_suffix(".tokenizer.json")
        if not rebuilt.is_file():
            build_tokenizer(read_gguf(vocabulary)).save(str(rebuilt))


def _extract(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", scratch, PACKAGE],
            check=True,
        )  # fmt: skip
        (archive,) = Path(scratch).glob("*.tar.gz")
        with tarfile.open(archive) as sdist:
            root = sdist.getnames()[0].split("/")[0]
            for name in FILES:
                member = sdist.extractfile(f"{root}/{MODELS}{name}")
                if member is None:
                    raise SystemExit(f"fetch_chat_formats: {PACKAGE} has no {MODELS}{name}")
                (target / Path(name).name).write_bytes(member.read())


if __name__ == "__main__":
    fetch(formats_dir())
    print(formats_dir())
