"""Shared pieces of the page-pool tests: sequences, a tiny real KV pool, expected hash chains, a reference
of what each page holds."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gpu_runtime.kv_cache.kv_pool import KVPool
from gpu_runtime.kv_cache.manager import page_hash
from gpu_runtime.sampling_params import SamplingParams
from gpu_runtime.sequence import Sequence

SALT = b"model-a"


def make_seq(name: str, prompt: list[int] | None = None, max_tokens: int = 16) -> Sequence:
    return Sequence(
        name,
        [1, 2, 3] if prompt is None else list(prompt),
        SamplingParams(max_tokens=max_tokens),
        max_model_len=1 << 20,
        eos_token_ids=frozenset(),
    )


def tiny_pool(num_pages: int, page_size: int) -> KVPool:
    config = SimpleNamespace(num_layers=1, num_kv_heads=1, head_dim=1)
    return KVPool(config, num_pages, page_size, torch.float64, "cpu")


def chain_hashes(tokens: list[int], page_size: int, num_pages: int, salt: bytes = SALT) -> list[bytes]:
    """The chained content hashes of the first `num_pages` full pages of `tokens`."""
    hashes, parent = [], b""
    for i in range(num_pages):
        parent = page_hash(parent, tokens[i * page_size : (i + 1) * page_size], salt)
        hashes.append(parent)
    return hashes


class PageContents:
    """What each page's K/V holds, in a real KVPool: slot s holds an id naming the context that produced it.

    K/V at position i depends on tokens[0..i], so the id names that whole tuple; V holds minus K, so a copy
    that moved only one of them shows up too. Garbage (a raw holder's scratch data) has negative ids.
    """

    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.pool = tiny_pool(num_pages, page_size)
        self._ids: dict[tuple[int, ...], int] = {}
        self._garbage = 0

    def id_of(self, context: list[int] | tuple[int, ...]) -> int:
        return self._ids.setdefault(tuple(context), len(self._ids) + 1)

    def expected(self, tokens: list[int] | tuple[int, ...], page_index: int) -> list[float]:
        """The ids page `page_index` of a sequence with these tokens holds once computed."""
        start = page_index * self.page_size
        return [float(self.id_of(tokens[: start + s + 1])) for s in range(self.page_size)]

    def _write(self, page: int, slot: int, value: float) -> None:
        for k, v in self.pool.layers:
            k[page, slot, 0, 0] = value
            v[page, slot, 0, 0] = -value

    def write_context(self, page: int, slot: int, context: list[int]) -> None:
        self._write(page, slot, float(self.id_of(context)))

    def scribble(self, page: int) -> None:
        for slot in range(self.page_size):
            self._garbage -= 1
            self._write(page, slot, float(self._garbage))

    def read(self, page: int) -> list[float]:
        k, v = self.pool.layers[0]
        keys = k[page, :, 0, 0].tolist()
        assert v[page, :, 0, 0].tolist() == [-x for x in keys], f"page {page}: K and V disagree"
        return keys
