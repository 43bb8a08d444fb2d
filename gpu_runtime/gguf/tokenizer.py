"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, rebuilt as a `tokenizers` Tokenizer
(tokenizer.json) plus the tokenizer_config.json of its special tokens and chat template.

A GGUF holds the vocabulary, the merges, each token's type and `tokenizer.ggml.pre`, the name of the way llama.cpp
splits text into words before merging. Byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2": SmolLM,
Llama 3, Qwen2, ...) are rebuilt here, with the split llama.cpp uses for their pre-tokenizer name; SentencePiece
vocabularies (`llama`: Llama 2, Mistral, Gemma, ...) in sentencepiece.py. Other tokenizer models, and pre-tokenizer
names this table lacks, are refused by name rather than guessed.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from gpu_runtime.gguf.reader import GGUFFile
from gpu_runtime.gguf.sentencepiece import MERGES_BY_POSITION as _MERGES_BY_POSITION
from gpu_runtime.gguf.sentencepiece import sentencepiece_tokenizer

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4  # llama.cpp's token types

# The splits of llama.cpp's llama-vocab.cpp, spelled as the models' own tokenizer.json files spell them.
_GPT2 = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
_DIGITS_THEN_GPT2 = [pre_tokenizers.Digits(individual_digits=True), *_GPT2]
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str) -> list:
    return [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]


PRE_TOKENIZERS = {
    **dict.fromkeys(["default", "gpt-2", "mpt", "olmo", "jais"], _GPT2),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"], _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"], _split_then_bytes(_LLAMA3_SPLIT)
    ),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen"], _split_then_bytes(_QWEN2_SPLIT)),
}


def build_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """Raises ValueError naming the tokenizer model or pre-tokenizer when it is not one tokend rebuilds."""
    metadata = gguf.metadata
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level(metadata)
    elif kind == "llama":
        tokenizer = sentencepiece_tokenizer(metadata, by_position=gguf.architecture in _MERGES_BY_POSITION)
    else:
        raise ValueError(f"model: GGUF tokenizer model {kind!r} is not supported; tokend rebuilds 'gpt2' (byte-level "
                         "BPE) and 'llama' (SentencePiece BPE)")  # fmt: skip
    # Control tokens (<|im_start|>) are special: matched whole in text and skipped when decoding; user-defined
    # ones (<think>) are matched whole but decoded as text. Both keep their ids: each is in the vocabulary already.
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    kinds = list(zip(tokens, types, strict=True))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == _USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == _CONTROL])
    tokenizer.post_processor = _post_processor(metadata, tokens, byte_level=kind == "gpt2")
    return tokenizer


def _byte_level(metadata: dict[str, Any]) -> Tokenizer:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"model: GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(PRE_TOKENIZERS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _post_processor(metadata: dict[str, Any], tokens: list[str], byte_level: bool) -> processors.PostProcessor:
    """BOS and EOS around each text as the file's add_bos_token / add_eos_token say (off unless said: the converter
    writes what the model's tokenizer does), and byte-level offsets for a byte-level vocabulary."""
    single, special = "$A", []
    for key, position in (("bos", "prefix"), ("eos", "suffix")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if metadata.get(f"tokenizer.ggml.add_{key}_token", False) and token_id is not None:
            text = tokens[token_id]
            single = f"{text} {single}" if position == "prefix" else f"{single} {text}"
            special.append((text, int(token_id)))
    template = processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=special)
    return processors.Sequence([processors.ByteLevel(trim_offsets=False), template]) if byte_level else template


def tokenizer_config(gguf: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens' texts, the BOS/EOS flags and the chat template."""
    metadata = gguf.metadata
    tokens = metadata["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    config["add_bos_token"] = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    context = gguf.hparam("context_length")
    if context:
        config["model_max_length"] = int(context)
    if isinstance(metadata.get("tokenizer.chat_template"), str):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config
