"""Benchmark workloads, reproducible from a seed: what to send (prompt token ids, output length, class)."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    interactive: bool = True
    prompt_text: str | None = None  # what a text endpoint (chat) sends; its token count comes back in usage


# Common English words, most of them one token in a BPE vocabulary: chat prompts when no tokenizer is at hand.
_WORDS = (  # noqa: SIM905 (a sentence reads better than 100 quoted words)
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use an each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number no "
    "way could people my than first water been call who oil its now find long down day did get come made may part"
).split()


def with_prompt_text(requests: list[BenchRequest], tokenizer, seed: int) -> list[BenchRequest]:
    """The requests with a text prompt, for endpoints that take text: the prompt's token ids decoded by the served
    model's tokenizer (a `tokenizers.Tokenizer`), as vLLM's random dataset makes its prompts; without one, as many
    common words as the prompt has tokens."""
    rng = random.Random(seed)
    texts = [
        tokenizer.decode(r.prompt_token_ids)
        if tokenizer is not None
        else " ".join(rng.choice(_WORDS) for _ in r.prompt_token_ids)
        for r in requests
    ]
    return [dataclasses.replace(r, prompt_text=text) for r, text in zip(requests, texts, strict=True)]


def random_dataset(num: int, vocab: int, input_len: int, output_len: int, range_ratio: float, seed: int):
    """vLLM's `random`: lengths uniform in [len * (1 - r), len * (1 + r)], tokens uniform over the vocabulary."""
    rng = random.Random(seed)

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    return [
        BenchRequest([rng.randrange(vocab) for _ in range(length(input_len))], length(output_len)) for _ in range(num)
    ]


def long_tail_dataset(num: int, vocab: int, seed: int, mean_output: int = 128, max_output: int = 1024):
    """Prompts of 32-512 tokens, exponential output lengths (mean 128, capped at 1024): the case where a static
    batch waits for its longest member."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 512))]
        requests.append(BenchRequest(prompt, min(max_output, max(1, round(rng.expovariate(1 / mean_output))))))
    return requests


def prefix_repetition_dataset(
    num: int,
    vocab: int,
    seed: int,
    num_prefixes: int = 10,
    prefix_len: int = 256,
    suffix_len: int = 256,
    output_len: int = 128,
):
    """Requests that share one of a few long prefixes (system prompts), each with its own suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        BenchRequest(rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(suffix_len)], output_len)
        for _ in range(num)
    ]


def mixed_priority_dataset(num: int, vocab: int, input_len: int, output_len: int, seed: int):
    """`random` requests, alternately interactive and batch (the class travels over gRPC)."""
    base = random_dataset(num, vocab, input_len, output_len, 0.0, seed)
    return [BenchRequest(r.prompt_token_ids, r.output_len, interactive=i % 2 == 0) for i, r in enumerate(base)]
