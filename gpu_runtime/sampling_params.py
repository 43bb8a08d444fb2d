"""SamplingParams: how one request picks its tokens, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Shaped like vLLM's. Every bad value raises ValueError naming the field."""

    max_tokens: int = 16  # tokens to generate at most; the context length also stops a sequence
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # a seeded request samples the same tokens whatever shares its batch
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)  # finish on any of these, eos or not
    ignore_eos: bool = False  # keep generating past the model's eos ids (benchmarks)
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; n: also the top n

    def __post_init__(self) -> None:
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        _require(self.seed is None or isinstance(self.seed, int), "seed", "an integer or None", self.seed)
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids", "non-negative integers", self.stop_token_ids,
        )
        _require(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            "logprobs", "None or an integer in [0, 20]", self.logprobs,
        )
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, name: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name}: must be {expected}, got {value!r}")
