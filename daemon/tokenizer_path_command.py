"""`tokend tokenizer-path [--model NAME]`: the directory holding a model's tokenizer.json and tokenizer_config.json,
what clients that count tokens themselves need (guidellm's --processor, vLLM's bench --tokenizer, tokend bench's
--tokenizer). A built-in name's directory lives in tokend's cache, the default model's converted on first use."""

from __future__ import annotations

import argparse
import sys

HELP = "print the directory holding a model's tokenizer (for guidellm, vLLM's benchmark, tokend bench --tokenizer)"
# What transformers.AutoTokenizer.from_pretrained(dir) reads for a fast tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def add_tokenizer_path_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="a built-in model's name, a checkpoint directory or a .gguf file (default: the default model)",
    )


def run_tokenizer_path(args: argparse.Namespace) -> int:
    from gpu_runtime.default_model import resolve_model_dir

    try:
        directory = resolve_model_dir(args.model)
    except ValueError as error:
        print(f"tokend tokenizer-path: {error}", file=sys.stderr)
        return 2
    missing = [name for name in TOKENIZER_FILES if not (directory / name).is_file()]
    if missing:
        print(f"tokend tokenizer-path: {directory} has no {' or '.join(missing)}", file=sys.stderr)
        return 1
    print(directory.resolve())
    return 0
