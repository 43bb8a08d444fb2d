"""The OpenAI surface that clients nobody here wrote rely on, through the official `openai` client and raw SSE: the
chat stream's role arrives with the first token (never ahead of prefill), model objects with vLLM's `root` and
`parent`, `GET /v1/models/{id}` (aliases too), and batches of prompts in `/v1/completions`."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import openai
import pytest
from daemon_harness import Daemon, standalone_gateway

from frontend.gateway.openai_requests import MAX_BATCH_CHOICES
from tokend.v1 import tokend_pb2 as pb

MODEL = "tiny"
ALIAS = "fast"
PROMPTS = ["The batch begins", "A second, longer prompt of the batch", "Third"]
TOKEN_PROMPTS = [[72, 101, 108, 108, 111], [87, 111, 114, 108, 100, 33, 32, 49], [50]]
MESSAGES = [{"role": "user", "content": "Say something."}]
GREEDY = dict(max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("surface") / "tokend.toml"
    # No shedding by projected TTFT: the largest batch's 128 prompts at once would pass the 2 s default on a busy
    # machine, and admission's policy is test_admission's subject, not this file's.
    config.write_text(f'interactive_ttft_target = 1000\n[[models]]\nname = "{MODEL}"\npath = "tokend-tiny-random"\n'
                      f'aliases = ["{ALIAS}"]\n')  # fmt: skip
    with Daemon("--config", str(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _sse_lines(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        return [line for line in reply.iter_lines() if line]


def _data(lines: list[str]) -> list[dict]:
    return [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]


# -- the chat stream's first chunk ----------------------------------------------------------------------------------


def test_every_chat_chunk_carries_a_token_and_the_first_also_the_role(daemon, client):
    """vLLM's benchmark client times the first token by the first chunk with choices: no chunk may come before one."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body |= {"n": 2, "logprobs": True, "stream": True}
    chunks = [c for c in _data(_sse_lines(daemon.http_url, "/v1/chat/completions", body)) if c["choices"]]
    first_of = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        assert len(choice["logprobs"]["content"]) >= 1  # a token in every chunk: none says only the role
        first_of.setdefault(choice["index"], choice)
    assert sorted(first_of) == [0, 1]
    for choice in first_of.values():
        assert choice["delta"]["role"] == "assistant" and isinstance(choice["delta"]["content"], str)
    assert sum("role" in c["choices"][0]["delta"] for c in chunks) == 2  # said once per choice
    # The official client reassembles the same answer as the non-streamed call gives.
    options = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    streamed = list(client.chat.completions.create(**options, stream=True))
    assert streamed[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == client.chat.completions.create(**options).choices[0].message.content


def test_before_a_long_prefills_first_token_only_keep_alive_comments_go_out(daemon):
    """The role chunk never runs ahead of the prefill: whatever precedes the first data line is a keep-alive comment.
    (How many there are is the machine's to say: a starved gateway may find the first token already there;
    test_gateway_keepalive shows the comments over a call that stays quiet.)"""
    with standalone_gateway(daemon, "--sse-keepalive", "0.001") as url:
        long_chat = [{"role": "user", "content": "long " * 380}]  # its prefill: a quiet spell of many keep-alives
        lines = _sse_lines(url, "/v1/chat/completions", {"messages": long_chat, "max_tokens": 2, "stream": True})
        first_data = next(index for index, line in enumerate(lines) if line.startswith("data: "))
        assert set(lines[:first_data]) <= {": keep-alive"}
        first = json.loads(lines[first_data].removeprefix("data: "))
        assert first["choices"][0]["delta"]["role"] == "assistant"
        assert lines[-1] == "data: [DONE]"


# -- models ---------------------------------------------------------------------------------------------------------


def test_models_have_root_and_parent_and_each_is_retrievable_by_name_or_alias(daemon, client):
    (listed,) = client.models.list().data
    assert (listed.id, listed.root, listed.parent, listed.owned_by) == (MODEL, MODEL, None, "tokend")
    retrieved = client.models.retrieve(MODEL)
    assert retrieved.model_dump() == listed.model_dump()
    by_alias = client.models.retrieve(ALIAS)
    assert (by_alias.id, by_alias.root, by_alias.max_model_len) == (ALIAS, MODEL, listed.max_model_len)
    assert listed.model_extra["has_chat_template"] is True  # the tiny model's tokenizer_config.json has one
    (model,) = daemon.generation.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert list(model.aliases) == [ALIAS] and model.has_chat_template  # gRPC's ListModels says it too


def test_retrieving_an_unknown_model_is_openais_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    assert "no-such-model" in caught.value.body["message"]


# -- batches of prompts ---------------------------------------------------------------------------------------------


def _one_by_one(client, prompts, **options):
    return [client.completions.create(model=MODEL, prompt=prompt, **options) for prompt in prompts]


@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS], ids=["strings", "token-id-lists"])
def test_a_batch_answers_each_prompt_as_alone_with_index_prompt_times_n_plus_choice(client, prompts):
    options = dict(max_tokens=8, temperature=1.0, seed=11, n=2, extra_body={"ignore_eos": True})
    batch = client.completions.create(model=MODEL, prompt=prompts, **options)
    alone = _one_by_one(client, prompts, **options)
    assert [c.index for c in batch.choices] == list(range(len(prompts) * 2))
    assert [c.text for c in batch.choices] == [c.text for single in alone for c in single.choices]
    assert len({c.text for c in batch.choices}) > 1
    assert batch.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in alone)
    assert batch.usage.completion_tokens == len(prompts) * 2 * 8
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_a_streamed_batch_interleaves_choices_by_index_and_sums_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, **GREEDY)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    texts: dict[int, str] = defaultdict(str)
    finish = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert dict(texts) == {c.index: c.text for c in whole.choices}
    assert set(finish.values()) == {"length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.model_dump() == whole.usage.model_dump()
    assert usage.completion_tokens == len(PROMPTS) * 2 * 6


def test_one_list_of_token_ids_is_one_prompt(client):
    (single,) = client.completions.create(model=MODEL, prompt=TOKEN_PROMPTS[1], **GREEDY).choices
    assert single.index == 0
    assert single.text == client.completions.create(model=MODEL, prompt=[TOKEN_PROMPTS[1]], **GREEDY).choices[0].text


def test_each_call_of_a_batch_is_the_request_id_with_its_choices_index(daemon, client):
    client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=2, extra_headers={"X-Request-Id": "batch-ids"}
    )
    with daemon.ledger() as ledger:
        rows = ledger.execute("SELECT request_id, prompt_tokens FROM usage WHERE request_id LIKE 'batch-ids-%'")
        ids = sorted(row["request_id"] for row in rows)
    assert ids == ["batch-ids-0", "batch-ids-1", "batch-ids-2", "batch-ids-3"]


@pytest.mark.parametrize(
    ("prompt", "n", "param"),
    [
        (["x"] * (MAX_BATCH_CHOICES + 1), 1, "prompt"),
        (["x"] * (MAX_BATCH_CHOICES // 4 + 1), 4, "prompt"),
        (["x", [1, 2]], 1, "prompt"),  # strings and token ids mixed
        (["x", 3], 1, "prompt"),
        ([[1, 2], [3, -1]], 1, "prompt[1]"),
        (["fine", "fine", "long " * 3000], 2, "prompt[2]"),  # refused by the frontend: no room in the context
    ],
    ids=["too-many-prompts", "too-many-choices", "mixed-lists", "mixed-items", "bad-token-id", "too-long"],
)
def test_a_batch_out_of_bounds_or_mixed_is_a_400_naming_prompt(daemon, prompt, n, param):
    reply = httpx.post(f"{daemon.http_url}/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": 1})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert httpx.get(f"{daemon.http_url}/health").status_code == 200


def test_the_largest_batch_allowed_is_answered_in_full(client):
    prompts = [f"p{i}" for i in range(MAX_BATCH_CHOICES)]
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=2, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == list(range(MAX_BATCH_CHOICES))
    assert batch.usage.completion_tokens == 2 * MAX_BATCH_CHOICES
