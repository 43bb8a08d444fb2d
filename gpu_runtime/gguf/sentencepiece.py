"""A SentencePiece vocabulary from GGUF metadata (`tokenizer.ggml.model` "llama": Llama 2, Mistral, Gemma, Phi-3's
files) rebuilt as a `tokenizers` BPE, the way llama.cpp tokenizes with it.

The file holds each piece, its score and its type, but no merges: llama.cpp joins the adjacent pair whose joined
text is the piece with the highest score, again and again. A BPE whose merges are every split of every piece into
two pieces, ranked by the joined piece's score, does the same. Characters no piece covers fall back to their UTF-8
bytes (the `<0x41>` pieces). Spaces are spelled "▁", and a "▁" goes before the text (and after each special token)
where the file's add_space_prefix says so (its default: true; Gemma's converter writes false).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers

SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space
_UNKNOWN = 2  # llama.cpp's token type for the unknown piece
# Families whose scores do not follow the order their merges were learnt in, where the order of the pieces in the
# file does (transformers reads Gemma's files the same way).
MERGES_BY_POSITION = frozenset({"gemma", "gemma2", "gemma3"})


def sentencepiece_tokenizer(metadata: dict[str, Any], by_position: bool = False) -> Tokenizer:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    if by_position:  # Gemma stores its runs of spaces as spaces; its text reaches the model spelled with "▁"
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        scores = [-float(i) for i in range(len(tokens))]
    else:
        scores = [float(s) for s in metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
    ids = {token: i for i, token in reversed(list(enumerate(tokens)))}  # a repeated piece keeps its first id
    types = metadata.get("tokenizer.ggml.token_type") or []
    unknown = next((tokens[i] for i, kind in enumerate(types) if kind == _UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=ids, merges=derive_merges(tokens, scores, ids), unk_token=unknown, byte_fallback=True, fuse_unk=True
        )
    )
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tokenizer


def derive_merges(tokens: list[str], scores: list[float], ids: dict[str, int]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, the best first: by the joined piece's score, then (on a tie) the
    longer left part, then the joined piece's and the parts' order in the vocabulary."""
    ranked = []
    for joined_id, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-score, -len(left), -len(right), joined_id, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]
