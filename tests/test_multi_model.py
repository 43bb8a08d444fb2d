"""Several models of different sizes served at once: routed by name or alias, spread over their groups."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from conftest import random_prompts
from daemon_harness import Daemon

from gpu_runtime import LLM, SamplingParams
from tokend.v1 import tokend_pb2 as pb

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, llama_dir):
    config = tmp_path_factory.mktemp("models") / "tokend.toml"
    config.write_text(
        f"""
[[models]]
name = "tiny"
path = "tokend-tiny-random"
aliases = ["default-alias"]

[[models]]
name = "llama-small"
path = "{llama_dir}"
aliases = ["small"]
groups = ["cpu", "cpu"]
"""
    )
    with Daemon("--config", str(config), "--tenant-metrics") as running:
        yield running


def _greedy(daemon: Daemon, model: str, prompts: list[list[int]]) -> list[list[int]]:
    def one(prompt):
        request = pb.GenerateRequest(
            model=model,
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
        )
        return [t for chunk in daemon.generation.Generate(request, timeout=120) for t in chunk.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _in_process(model_path, prompts: list[list[int]]) -> list[list[int]]:
    outputs = LLM(model_path).generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True),
    )
    return [o.outputs[0].token_ids for o in outputs]


def test_each_model_answers_as_it_does_in_process(daemon, llama_dir):
    prompts = random_prompts(8, 4, 40, seed=11)
    small = _greedy(daemon, "small", prompts)
    tiny = _greedy(daemon, "tiny", prompts)
    assert small == _greedy(daemon, "llama-small", prompts)
    assert tiny == _greedy(daemon, "default-alias", prompts) == _greedy(daemon, "", prompts)
    assert small == _in_process(str(llama_dir), prompts)
    assert tiny == _in_process("tokend-tiny-random", prompts)
    assert small != tiny


def test_a_pool_of_two_groups_shares_the_work(daemon):
    before = daemon.steps_by_group("llama-small")
    _greedy(daemon, "llama-small", random_prompts(8, 4, 40, seed=12))
    assert set(daemon.wait_every_group_stepped("llama-small", before)) == {"0", "1"}  # both ran some of the eight
    load = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert sorted((s.model, s.group) for s in load.schedulers) == [
        ("llama-small", "0"),
        ("llama-small", "1"),
        ("tiny", "0"),
    ]


def test_the_schedulers_share_the_cores_left_after_the_frontend(daemon):
    """Three schedulers on this machine: together they start no more torch threads than there are cores
    beside the frontend's (threads beyond the cores make every parallel op wait), and each gets one at least."""
    threads = [entry["torch_threads"] for entry in daemon.log_entries("engine_ready")]
    cores = len(os.sched_getaffinity(0))
    assert len(threads) == 3 and min(threads) >= 1
    assert sum(threads) <= max(3, cores - 1)


def test_models_are_listed_and_an_unknown_one_is_not_found(daemon):
    models = daemon.generation.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [m.name for m in models] == ["tiny", "llama-small"] and all(m.ready for m in models)
    with pytest.raises(grpc.RpcError) as caught:
        list(daemon.generation.Generate(pb.GenerateRequest(model="huge", prompt="x"), timeout=10))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_ledger_and_prometheus_agree_per_model(daemon):
    """Both models serve the same prompt three times in a row (so prefixes are cached): per model, the usage
    ledger and the per-tenant counters (tenant "" with authentication off) hold the same numbers."""
    (prompt,) = random_prompts(1, 40, 40, seed=13)  # two full pages and more
    for model in ("tiny", "llama-small"):
        for _ in range(3):  # llama-small has two groups: two of three sends meet on one, the later one cached there
            _greedy(daemon, model, [prompt])
    with daemon.ledger() as db:
        ledger = {
            model: (requests, prompt, completion, cached)
            for model, requests, prompt, completion, cached in db.execute(
                "SELECT model, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), SUM(cached_tokens)"
                " FROM usage WHERE status = 'finished' GROUP BY model"
            )
        }
    assert set(ledger) == {"tiny", "llama-small"}
    for model, counts in ledger.items():
        labels = {"tenant": "", "model_name": model}
        assert counts == (
            daemon.metric("tokend:tenant_requests_total", status="finished", **labels),
            daemon.metric("tokend:tenant_prompt_tokens_total", **labels),
            daemon.metric("tokend:tenant_completion_tokens_total", **labels),
            daemon.metric("tokend:tenant_cached_tokens_total", **labels),
        )
        assert counts[3] > 0, f"{model}: a repeated prompt was served from the prefix cache"
