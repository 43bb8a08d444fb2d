"""SamplingParams: how one request picks its tokens; validated on construction and again when decoded off the wire."""

from __future__ import annotations

import msgspec

from common.checks import is_int, is_number, require
from gpu_runtime.ipc.pooling import PoolingParams
from gpu_runtime.ipc.structured_output import StructuredOutput


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Shaped like vLLM's, and like vLLM's one struct from the frontend to the sampler: it crosses the IPC boundary
    as it is. Every bad value raises ValueError naming the field (msgspec.ValidationError when decoded).

    Stop strings are not here: the frontend owns the text and matches them there.
    """

    # Tokens to generate at most; the context length also stops a sequence. 0 with prompt_logprobs: the prompt is
    # only scored (completions' echo with max_tokens 0) and the request ends with finish reason LENGTH; 0 with
    # pooling: the prompt is only embedded.
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus: keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None  # a seeded request samples the same tokens whatever shares its batch
    stop_token_ids: tuple[int, ...] = ()  # finish on any of these, eos or not
    ignore_eos: bool = False  # keep generating past the model's eos ids (benchmarks)
    logprobs: int | None = None  # None: no logprobs; 0: the sampled token's; n: also the top n
    # The prompt's own tokens' logprobs (vLLM's prompt_logprobs; OpenAI completions' echo with logprobs): None: not
    # computed; 0: each prompt token's from the second on; n: also the top n at each of those positions.
    prompt_logprobs: int | None = None
    # Penalties as vLLM defines them. Presence and frequency (OpenAI's) look at the tokens generated so far:
    # each seen token's logit loses presence_penalty once and frequency_penalty per occurrence. Repetition
    # (transformers' and vLLM's) looks at prompt and output: a seen token's logit is divided by it when
    # positive, multiplied by it otherwise.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to those tokens' logits before the penalties; a dict is accepted and kept
    # sorted by id, so that equal requests are equal (and hashable) whatever order their bias came in.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The output must satisfy this (a JSON Schema, a regex, a grammar...): every step, tokens it does not allow
    # are masked out before anything else sees the logits (gpu_runtime.structured).
    structured_output: StructuredOutput | None = None
    # An embedding request (gpu_runtime.pooling): the prompt's hidden states pooled into one vector, nothing
    # generated (max_tokens 0); its final delta carries the embedding.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        require(is_int(self.max_tokens) and self.max_tokens >= 0, "max_tokens", "an integer >= 1", self.max_tokens)
        require(self.max_tokens > 0 or self.prompt_logprobs is not None or self.pooling is not None, "max_tokens",
                "an integer >= 1 (0 only with prompt_logprobs or pooling: a prompt to score or embed)",
                self.max_tokens)  # fmt: skip
        require(self.pooling is None or (self.max_tokens == 0 and self.prompt_logprobs is None), "pooling",
                "set only with max_tokens 0 and no prompt_logprobs (an embedding generates nothing)",
                self.pooling)  # fmt: skip
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
        require(
            self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            "None or an integer in [0, 20]",
            self.prompt_logprobs,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(
                is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                name,
                f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
                value,
            )
        rep = self.repetition_penalty
        require(is_number(rep) and rep > 0, "repetition_penalty", "a number > 0 (1 = off)", rep)
        if isinstance(self.stop_token_ids, list):  # a list given in Python; the wire already decodes a tuple
            msgspec.structs.force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        msgspec.structs.force_setattr(self, "logit_bias", _checked_logit_bias(self.logit_bias))

    @property
    def is_greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; such a temperature means greedy anyway.
        return self.temperature < _GREEDY_BELOW_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a logit bias changes this request's logits (rows without skip gpu_runtime.penalties)."""
        return bool(
            self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )


_GREEDY_BELOW_TEMPERATURE = 1e-5
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias: +-100 bans or forces a token anyway
MAX_LOGIT_BIAS_ENTRIES = 300  # tokens one request may bias, so its size (and the sampler's work) stays small


def _checked_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """The bias as (id, bias) pairs sorted by id; ValueError naming logit_bias and the first bad entry."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    if not isinstance(pairs, (list, tuple)):
        raise ValueError(f"logit_bias: must be a map of token ids to biases, got {type(value).__name__}")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_ENTRIES} tokens may be biased, got {len(pairs)}")
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and is_int(pair[0]) and pair[0] >= 0):
            raise ValueError(f"logit_bias: each key must be a token id >= 0, got {pair!r}")
        if not (is_number(pair[1]) and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS):
            raise ValueError(
                f"logit_bias: the bias of token {pair[0]} must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                f"got {pair[1]!r}"
            )
    if len({token_id for token_id, _ in pairs}) != len(pairs):
        raise ValueError("logit_bias: a token id appears twice")
    return tuple(sorted((token_id, float(bias)) for token_id, bias in pairs))


class SamplingDefaults(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A model's own defaults for the sampling fields a request leaves unset (read from its generation_config.json
    by gpu_runtime.generation_defaults, as vLLM's --generation-config auto does); None: SamplingParams' default.

    The engine reads them with the checkpoint and sends them in its SchedulerReady; the frontend fills them in,
    since only it knows which fields a request set.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    def as_dict(self) -> dict[str, float | int]:
        """The defaults that are set, by SamplingParams field name."""
        return {name: value for name in self.__struct_fields__ if (value := getattr(self, name)) is not None}
