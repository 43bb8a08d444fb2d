"""The newer families through a real daemon: Qwen3 (per-head q/k norms), Mixtral and Qwen3-MoE (sparse and dense
layers), Gemma 2 and Gemma 3 (sliding windows, soft-caps, Gemma 3's own local theta) and Phi-3 (fused projections,
every layer windowed) served side by side from one config file. Over gRPC each streams transformers' greedy tokens
for 16 prompts x 48 tokens, in 64-token prefill chunks beside running decodes, and a second round finds the shared
prefix (longer than the windows) in the prefix cache and still streams the same tokens. A daemon at
tensor_parallel_size=2 (every model's group two rank processes) streams the same tokens for Gemma 3 (its
soft-capped logits gathered from both ranks' vocabulary shards) and Qwen3-MoE (each expert split across the ranks).
(Offline, per attention backend and at tensor_parallel_size=2: test_model_families.py.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from checkpoints import GEMMA2, GEMMA3, MIXTRAL, PHI3, QWEN3, QWEN3_MOE, write_checkpoint
from conftest import NUM_REFERENCE_TOKENS, transformers_greedy
from daemon_harness import Daemon
from test_model_families import SHARED_PREFIX, family_prompts

from tokend.v1 import tokend_pb2 as pb

FAMILIES = {
    "qwen3": QWEN3,
    "mixtral": MIXTRAL,
    "qwen3-moe": QWEN3_MOE,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "phi3": PHI3,
}
TENSOR_PARALLEL_FAMILIES = ("gemma3", "qwen3-moe")


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> tuple[list[list[int]], dict[str, tuple[str, list[list[int]]]]]:
    """The prompts, and each family's checkpoint with transformers' greedy tokens for them."""
    prompts = family_prompts()
    made = {}
    for name, spec in FAMILIES.items():
        model_dir = write_checkpoint(tmp_path_factory.mktemp(name), spec)
        made[name] = str(model_dir), transformers_greedy(model_dir, prompts, NUM_REFERENCE_TOKENS)
    return prompts, made


def _daemon(tmp_path_factory, references, names, *options: str) -> Daemon:
    """A daemon serving the named families from one config file, in 64-token prefill chunks."""
    _, made = references
    config = tmp_path_factory.mktemp("config") / "tokend.toml"
    config.write_text("\n".join(f'[[models]]\nname = "{name}"\npath = "{made[name][0]}"\n' for name in names))
    return Daemon("--config", str(config), "--max-num-batched-tokens", "64", *options)


@pytest.fixture(scope="module")
def served(tmp_path_factory, references):
    with _daemon(tmp_path_factory, references, FAMILIES) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def served_tensor_parallel(tmp_path_factory, references):
    with _daemon(tmp_path_factory, references, TENSOR_PARALLEL_FAMILIES, "--tensor-parallel-size", "2") as daemon:
        yield daemon


def _stream(daemon: Daemon, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """The streamed tokens and the cached prompt tokens the final usage reports."""
    request = pb.GenerateRequest(
        model=model,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(max_tokens=NUM_REFERENCE_TOKENS, temperature=0, ignore_eos=True),
    )
    chunks = list(daemon.generation.Generate(request, timeout=120))
    return [t for chunk in chunks for t in chunk.token_ids], chunks[-1].usage.cached_tokens


def _check(daemon: Daemon, references, name: str) -> None:
    prompts, made = references
    expected = made[name][1]
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(lambda p: _stream(daemon, name, p), prompts))
        assert [tokens for tokens, _ in first] == expected
        again = list(pool.map(lambda p: _stream(daemon, name, p), prompts))  # the prefixes are cached now
    assert [tokens for tokens, _ in again] == expected
    assert sum(cached for _, cached in again) >= SHARED_PREFIX * len(prompts) // 2


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_streams_transformers_greedy_tokens_with_prefix_caching_and_chunked_prefill(served, references,
                                                                                                name):  # fmt: skip
    _check(served, references, name)


@pytest.mark.parametrize("name", TENSOR_PARALLEL_FAMILIES)
def test_at_tensor_parallel_size_2_the_daemon_streams_the_same_tokens(served_tensor_parallel, references, name):
    _check(served_tensor_parallel, references, name)
