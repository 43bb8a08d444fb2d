"""Embeddings: how a request pools its prompt's hidden states into one vector (PoolingParams, carried inside its
SamplingParams), and what a model says it pools by (ModelPooling, in its SchedulerReady). Torch-free: the frontend
reads both."""

from __future__ import annotations

import enum

import msgspec

from common.checks import is_int, require


class PoolingType(enum.StrEnum):
    """Which hidden states make the embedding (sentence-transformers' pooling modes, vLLM's pooler types)."""

    LAST = "last"  # the last prompt token's: what decoder embedding models are trained for (e5-mistral, gte-Qwen)
    MEAN = "mean"  # the average over every prompt token
    CLS = "cls"  # the first token's


class PoolingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A request for the prompt's embedding instead of generated tokens (SamplingParams.pooling, with max_tokens 0).
    The hidden states are those after the model's final norm, as transformers' last_hidden_state."""

    type: PoolingType = PoolingType.LAST
    normalize: bool = True  # divided by its L2 norm (sentence-transformers' Normalize module), after truncation
    # Matryoshka truncation: only the first `dimensions` values (then normalized); None keeps the hidden size.
    dimensions: int | None = None

    def __post_init__(self) -> None:
        require(self.dimensions is None or (is_int(self.dimensions) and self.dimensions >= 1), "pooling.dimensions",
                "None or an integer >= 1", self.dimensions)  # fmt: skip

    @property
    def reads_every_position(self) -> bool:
        """Whether the embedding needs hidden states besides the last position's: then no prefix-cache hit may skip
        computing a position (its K/V is cached, but its hidden state is not)."""
        return self.type is not PoolingType.LAST


class ModelPooling(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a served model's embeddings are (read from its sentence-transformers files where it has them; else the
    last token, normalized, as vLLM pools a decoder): the defaults a request's PoolingParams starts from."""

    type: PoolingType = PoolingType.LAST
    normalize: bool = True
    hidden_size: int = 0  # the embedding's length
    # Matryoshka: which `dimensions` a request may ask for: () none (the model was not trained for truncation);
    # (0,) any from 1 to hidden_size; else exactly these (config.json's matryoshka_dimensions).
    matryoshka_dimensions: tuple[int, ...] = ()
    # Why this model cannot embed, when its sentence-transformers modules ask for what tokend does not compute (a
    # Dense layer, max pooling): its embedding requests are refused with it, never answered with another vector.
    unsupported: str = ""

    def dimensions_error(self, dimensions: int) -> str | None:
        """Why `dimensions` cannot be served by this model, or None."""
        if not self.matryoshka_dimensions:
            return "this model does not support matryoshka representation (it has no matryoshka_dimensions)"
        if self.matryoshka_dimensions == (0,):
            if 1 <= dimensions <= self.hidden_size:
                return None
            return f"must be in [1, {self.hidden_size}], got {dimensions}"
        if dimensions in self.matryoshka_dimensions:
            return None
        return f"must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
