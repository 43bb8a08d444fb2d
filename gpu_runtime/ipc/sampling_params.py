"""SamplingParams: how one request picks its tokens; validated on construction and again when decoded off the wire."""

from __future__ import annotations

import msgspec

from common.checks import is_int, is_number, require


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Shaped like vLLM's, and like vLLM's one struct from the frontend to the sampler: it crosses the IPC boundary
    as it is. Every bad value raises ValueError naming the field (msgspec.ValidationError when decoded).

    Stop strings are not here: the frontend owns the text and matches them there.
    """

    max_tokens: int = 16  # tokens to generate at most; the context length also stops a sequence
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # a seeded request samples the same tokens whatever shares its batch
    stop_token_ids: tuple[int, ...] = ()  # finish on any of these, eos or not
    ignore_eos: bool = False  # keep generating past the model's eos ids (benchmarks)
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; n: also the top n

    def __post_init__(self) -> None:
        require(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        require(is_number(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        require(is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        require(is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)", self.top_k)
        require(is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        require(self.seed is None or is_int(self.seed), "seed", "an integer or None", self.seed)
        require(
            isinstance(self.stop_token_ids, (list, tuple)) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of non-negative integers",
            self.stop_token_ids,
        )
        require(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "None or an integer in [0, 20]",
            self.logprobs,
        )
        if isinstance(self.stop_token_ids, list):  # a list given in Python; the wire already decodes a tuple
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; such a temperature means greedy anyway.
        return self.temperature < _GREEDY_BELOW_TEMPERATURE


_GREEDY_BELOW_TEMPERATURE = 1e-5
