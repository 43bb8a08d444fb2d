"""Embeddings in the engine (SamplingParams.pooling, LLM.embed): last-token, mean and cls pooling of the hidden states
after the final norm equal transformers' last_hidden_state pooled the same way, and sentence-transformers' encode
for a model saved with its modules, with chunked prefill, the prefix cache, preemption and generation in the same
batch; a base model's checkpoint (no lm_head) embeds and refuses to generate; Matryoshka truncation where the model
allows it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from checkpoints import GEMMA3, LLAMA_GQA, QWEN3, write_checkpoint, write_sentence_transformer
from conftest import kv_bytes_for

from gpu_runtime import LLM, SamplingParams
from gpu_runtime.ipc.pooling import PoolingParams, PoolingType

TOLERANCE = 1e-4
FAMILIES = {"llama": LLAMA_GQA, "qwen3": QWEN3, "gemma3": GEMMA3}  # gemma3: sliding windows shorter than prompts


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: write_checkpoint(tmp_path_factory.mktemp(name), spec) for name, spec in FAMILIES.items()}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 250) for _ in range(40)]  # a third begin alike: their pages are cached
    return [
        (shared if index % 3 == 0 else []) + [rng.randrange(3, 250) for _ in range(rng.randint(1, 120))]
        for index in range(count)
    ]


def _reference(model_dir, prompts: list[list[int]], pooling: PoolingType) -> torch.Tensor:
    """transformers' last_hidden_state pooled and L2-normalized: [prompts, hidden]."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            pooled = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}
            vectors.append(torch.nn.functional.normalize(pooled[pooling], dim=0))
    return torch.stack(vectors)


def _vectors(outputs) -> torch.Tensor:
    return torch.tensor([output.outputs.embedding for output in outputs])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_pooling_equals_transformers_with_chunked_prefill_and_the_prefix_cache(checkpoints, family):
    model_dir, prompts = checkpoints[family], _prompts(16, seed=4)
    requests = [{"prompt_token_ids": p} for p in prompts]
    # 48-token steps: most prompts are embedded over several chunks, and several share a step.
    with LLM(str(model_dir), max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True) as llm:
        for pooling in PoolingType:
            llm.embed(requests[:3], PoolingParams(pooling))  # the shared prefix's pages are cached from here on
            got = _vectors(llm.embed(requests, PoolingParams(pooling)))
            expected = _reference(model_dir, prompts, pooling)
            assert (got - expected).abs().max().item() < TOLERANCE, pooling
        assert llm.engine.kv.num_prefix_hit_tokens > 0  # last-token pooling took the cached prefixes


def test_embeddings_and_generation_share_a_batch_and_the_generations_are_unchanged(checkpoints):
    model_dir, prompts = checkpoints["llama"], _prompts(8, seed=6)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(str(model_dir), max_num_batched_tokens=64, max_num_seqs=8) as llm:
        alone = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
        for index, prompt in enumerate(prompts):  # queued together: the steps mix both kinds
            llm.engine.add_request(f"gen-{index}", prompt, greedy)
            llm.engine.add_request(f"emb-{index}", prompt, SamplingParams(max_tokens=0, pooling=PoolingParams()))
        tokens, vectors = {}, {}
        while llm.engine.has_unfinished_requests():
            for delta in llm.engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
                if delta.embedding is not None:
                    vectors[delta.request_id] = torch.frombuffer(bytearray(delta.embedding), dtype=torch.float32)
    assert [tokens[f"gen-{i}"] for i in range(len(prompts))] == [o.outputs[0].token_ids for o in alone]
    assert all(tokens[f"emb-{i}"] == [] for i in range(len(prompts)))  # an embedding generates no token
    expected = _reference(model_dir, prompts, PoolingType.LAST)
    assert (torch.stack([vectors[f"emb-{i}"] for i in range(len(prompts))]) - expected).abs().max() < TOLERANCE


def test_mean_pooling_after_preemption_folds_each_position_once(checkpoints):
    """A pool too small for the batch preempts running requests and recomputes them: each mean is still right."""
    model_dir, prompts = checkpoints["qwen3"], _prompts(12, seed=5)
    with LLM(str(model_dir), max_num_batched_tokens=64, max_num_seqs=12, enable_prefix_caching=True,
             kv_cache_bytes=kv_bytes_for(model_dir, 16, 24)) as llm:  # fmt: skip
        # Generation beside them holds pages and grows: the embeddings' prefills get preempted.
        for index, prompt in enumerate(prompts[:6]):
            llm.engine.add_request(f"gen-{index}", prompt[:30], SamplingParams(max_tokens=120, ignore_eos=True))
        got = _vectors(llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(PoolingType.MEAN)))
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        preemptions = llm.engine.stats.num_preemptions
    assert preemptions > 0
    assert (got - _reference(model_dir, prompts, PoolingType.MEAN)).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_a_sentence_transformers_model_embeds_as_its_encode_and_does_not_generate(tmp_path, mode):
    from sentence_transformers import SentenceTransformer

    model_dir = write_sentence_transformer(tmp_path, QWEN3, mode)
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["Qwen3Model"]
    texts = ["hello world", "The quick brown fox jumps over the lazy dog. " * 4, "ü€ unicode ✓"]
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(texts, batch_size=1, convert_to_tensor=True)
    with LLM(str(model_dir)) as llm:
        got = _vectors(llm.embed(texts))  # the model's own pooling, from its modules.json
        with pytest.raises(ValueError, match="model: .* serves embeddings only"):
            llm.generate("hello", SamplingParams(max_tokens=4))
    assert torch.nn.functional.cosine_similarity(got, expected).min().item() > 1 - TOLERANCE
    assert (got - expected).abs().max().item() < TOLERANCE


def test_dimensions_truncate_then_normalize_only_where_the_model_allows_it(tmp_path):
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=9)]
    plain = write_checkpoint(tmp_path / "plain", LLAMA_GQA)
    matryoshka = write_checkpoint(tmp_path / "matryoshka", LLAMA_GQA, matryoshka_dimensions=[16, 32])
    with LLM(str(plain)) as llm, pytest.raises(ValueError, match="pooling.dimensions: this model does not support"):
        llm.embed(prompts, PoolingParams(dimensions=16))
    with LLM(str(matryoshka)) as llm:
        whole = _vectors(llm.embed(prompts, PoolingParams(normalize=False)))
        short = _vectors(llm.embed(prompts, PoolingParams(dimensions=16)))
        with pytest.raises(ValueError, match=r"pooling.dimensions: must be one of \[16, 32\], got 24"):
            llm.embed(prompts, PoolingParams(dimensions=24))
    assert short.shape == (3, 16)
    assert (short - torch.nn.functional.normalize(whole[:, :16], dim=1)).abs().max().item() < 1e-6


def test_a_prompt_may_fill_the_whole_context_and_not_more(checkpoints):
    with LLM(str(checkpoints["llama"]), max_model_len=64) as llm:
        assert len(llm.embed({"prompt_token_ids": list(range(3, 67))})[0].outputs.embedding) == 64
        with pytest.raises(ValueError, match="prompt: 65 tokens are more than the context of 64"):
            llm.embed({"prompt_token_ids": list(range(3, 68))})
