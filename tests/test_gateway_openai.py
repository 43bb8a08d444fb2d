"""The HTTP/SSE gateway against a real `tokend serve`, through the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest
from daemon_harness import Daemon, standalone_gateway

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

PROMPT = "The gateway streams"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused-for-now", max_retries=0) as c:
        yield c


def _grpc_text(daemon: Daemon, request: pb.GenerateRequest) -> str:
    return "".join(chunk.text for chunk in daemon.generation.Generate(request, timeout=60))


def test_completions_streamed_and_not_agree_with_grpc_and_usage_counts_the_streamed_tokens(daemon, client):
    options = dict(
        model=TINY_RANDOM_MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}, logprobs=0))
    streamed_text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed_tokens = sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs)
    grpc_text = _grpc_text(
        daemon,
        pb.GenerateRequest(prompt=PROMPT, sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
    )
    assert whole.choices[0].text == streamed_text == grpc_text
    assert whole.choices[0].finish_reason == "length"
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == streamed_tokens == 24
    assert final.usage.total_tokens == final.usage.prompt_tokens + 24
    assert whole.usage.prompt_tokens == final.usage.prompt_tokens


def test_chat_streamed_and_not_agree_with_grpc_chat(daemon, client):
    options = dict(model=TINY_RANDOM_MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**options, extra_body={"ignore_eos": True})
    chunks = list(
        client.chat.completions.create(
            **options,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed_tokens = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES])
    grpc_text = _grpc_text(
        daemon, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    )
    assert whole.choices[0].message.content == streamed_text == grpc_text
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].usage.completion_tokens == streamed_tokens == 20 == whole.usage.completion_tokens
    assert whole.model == TINY_RANDOM_MODEL_NAME


def test_n_choices_with_a_seed_differ_and_repeat(client):
    options = dict(
        model=TINY_RANDOM_MODEL_NAME,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        seed=5,
        n=3,
        extra_body={"ignore_eos": True},
    )
    first, again = client.completions.create(**options), client.completions.create(**options)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 36


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == TINY_RANDOM_MODEL_NAME and model.owned_by == "tokend"


def test_health_and_metrics(daemon):
    assert httpx.get(f"{daemon.http_url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{daemon.http_url}/metrics").text
    assert 'tokend:http_requests_total{route="/v1/completions",status="200"}' in metrics


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "max_tokens": "many"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "model": "gpt-4"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 5000}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "temperature": -0.5}).encode(), 400, "temperature"),
        (json.dumps({"prompt": "x", "n": 9}).encode(), 400, "n"),
        (json.dumps({"prompt": "x", "stop": ["s"] * 9}).encode(), 400, "stop"),
        (json.dumps({"prompt": "x", "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({"prompt": "x", "prompt_logprobs": 21}).encode(), 400, "prompt_logprobs"),
        (json.dumps({"prompt": "x", "prompt_logprobs": -1}).encode(), 400, "prompt_logprobs"),
        (json.dumps({"prompt": "x", "echo": True, "logprobs": 21}).encode(), 400, "logprobs"),
        (json.dumps({"prompt": "x", "suffix": "y"}).encode(), 400, "suffix"),
        (json.dumps({"prompt": "x", "priority": "urgent"}).encode(), 400, "priority"),
        (json.dumps({"prompt": "x" * (5 << 20)}).encode(), 413, None),
    ],
)
def test_bad_completion_requests_get_openai_errors(daemon, body, status, param):
    reply = httpx.post(f"{daemon.http_url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert httpx.get(f"{daemon.http_url}/health").status_code == 200  # still serving


def test_bad_chat_requests_get_openai_errors(daemon, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_RANDOM_MODEL_NAME, messages=[], max_tokens=3)
    assert caught.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY_RANDOM_MODEL_NAME, messages=MESSAGES, max_completion_tokens=0)
    assert caught.value.body["param"] == "max_completion_tokens" or "max_tokens" in caught.value.body["param"]


def test_the_priority_field_sets_the_requests_admission_class(daemon, client):
    """The playground and batch clients name their class in the body; the ledger row shows what was applied."""
    for priority, request_id in (("batch", "prio-batch"), ("interactive", "prio-interactive"), (None, "prio-unset")):
        extra = {"priority": priority} if priority else {}
        client.chat.completions.create(
            model=TINY_RANDOM_MODEL_NAME,
            messages=MESSAGES,
            max_tokens=2,
            extra_body=extra,
            extra_headers={"X-Request-Id": request_id},
        )
    with daemon.ledger() as ledger:
        rows = ledger.execute("SELECT request_id, priority FROM usage WHERE request_id LIKE 'prio-%'").fetchall()
    assert {row["request_id"]: row["priority"] for row in rows} == {
        "prio-batch": "batch",
        "prio-interactive": "interactive",
        "prio-unset": "interactive",  # no tenants: everyone's class is interactive unless asked
    }


def test_ten_thousand_headers_get_431_in_openai_shape(daemon):
    headers = [(f"x-h{i}", "v") for i in range(10_000)]
    reply = httpx.post(f"{daemon.http_url}/v1/completions", json={"prompt": "x"}, headers=headers)
    assert reply.status_code == 431
    assert "headers" in reply.json()["error"]["message"]
    assert httpx.get(f"{daemon.http_url}/health").status_code == 200


def test_dropping_the_connection_mid_stream_aborts_the_sequence_within_a_second(daemon):
    body = {"prompt": PROMPT, "max_tokens": 1900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{daemon.http_url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        received = [line for _, line in zip(range(10), lines, strict=False)]
        assert any(line.startswith("data: ") for line in received)
        daemon.wait_for(lambda: daemon.metric("tokend:num_requests_running") > 0, timeout=5)
    # Leaving the block closed the connection mid-stream.
    daemon.wait_for(
        lambda: daemon.metric("tokend:num_requests_running") == 0 and daemon.metric("tokend:kv_cache_usage_perc") == 0,
        timeout=1.0,
    )


def test_a_standalone_gateway_keeps_a_quiet_stream_alive_with_comments(daemon):
    """--sse-keepalive reaches the stream, whose comments never break an event. (Whether the prefill's quiet spell is
    long enough for one to go out is the machine's to say: test_gateway_keepalive shows them deterministically.)"""
    with standalone_gateway(daemon, "--sse-keepalive", "0.001") as url:
        body = {"prompt": "long " * 380, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as reply:
            lines = [line for line in reply.iter_lines() if line]
        assert {line for line in lines if not line.startswith("data: ")} <= {": keep-alive"}
        # Two tokens, in two events or one (on a busy machine the second may join the first before it is sent).
        assert len([line for line in lines if line.startswith("data: {")]) in (1, 2) and lines[-1] == "data: [DONE]"


def test_echo_with_logprobs_scores_each_prompt_token_as_transformers_does(daemon, client):
    """What evaluation harnesses send to score a multiple-choice answer (lm-eval's local-completions): token-id
    prompts in a batch, echo, logprobs=1, max_tokens=1. Each choice's logprobs cover its prompt (the first token
    null) and then its one token, equal to transformers' teacher-forced log-softmax; the text is prompt + output.
    Streamed, the echo comes first; vLLM's prompt_logprobs field on chat, and gRPC's, say the same."""
    import torch
    from transformers import AutoModelForCausalLM

    from gpu_runtime.default_model import resolve_model_dir

    prompts = [[5, 9, 33, 80, 100, 7], [44 + i for i in range(30)], [200, 3]]
    reply = client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt=prompts, max_tokens=1, temperature=0,
                                      logprobs=1, echo=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(TINY_RANDOM_MODEL_NAME, "auto"), dtype=torch.float32)
    for prompt, choice in zip(prompts, sorted(reply.choices, key=lambda c: c.index), strict=True):
        with torch.inference_mode():
            expected = model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
        scored = choice.logprobs.token_logprobs
        assert len(scored) == len(prompt) + 1 and scored[0] is None and choice.logprobs.top_logprobs[0] is None
        wanted = [expected[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
        assert scored[1 : len(prompt)] == pytest.approx(wanted, abs=1e-4)
        best = [max(top.values()) for top in choice.logprobs.top_logprobs[1 : len(prompt)]]
        assert best == pytest.approx(expected[:-1].max(dim=-1).values.tolist(), abs=1e-4)
        assert choice.text.endswith(choice.logprobs.tokens[-1]) and len(choice.text) > len(choice.logprobs.tokens[-1])

    # max_tokens 0: the prompt alone, scored, nothing generated and nothing billed but the prompt.
    alone = client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt=[prompts[0]], max_tokens=0, echo=True,
                                      logprobs=1)  # fmt: skip
    first_scored = next(c for c in reply.choices if c.index == 0).logprobs.token_logprobs[: len(prompts[0])]
    assert alone.choices[0].logprobs.token_logprobs[0] is None
    assert alone.choices[0].logprobs.token_logprobs[1:] == pytest.approx(first_scored[1:], abs=1e-5)
    assert (alone.choices[0].finish_reason, alone.usage.completion_tokens) == ("length", 0)
    assert alone.usage.prompt_tokens == len(prompts[0])

    streamed = list(client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt=PROMPT, max_tokens=4,
                                              temperature=0, echo=True, stream=True))  # fmt: skip
    assert streamed[0].choices[0].text.startswith(PROMPT)
    whole = client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + whole.choices[0].text

    chat = client.chat.completions.create(model=TINY_RANDOM_MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 2})  # fmt: skip
    shaped = chat.model_extra["prompt_logprobs"]
    assert len(shaped) == chat.usage.prompt_tokens and shaped[0] is None
    assert all(2 <= len(position) <= 3 for position in shaped[1:])  # the prompt's token and the top 2

    sampling = pb.SamplingParams(max_tokens=2, prompt_logprobs=0)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[0]), sampling=sampling)
    first = next(iter(daemon.generation.Generate(request, timeout=60)))
    assert [e.token_id for e in first.prompt_logprobs] == prompts[0] and math.isnan(first.prompt_logprobs[0].logprob)
    over_http = next(c for c in reply.choices if c.index == 0).logprobs.token_logprobs[1 : len(prompts[0])]
    assert [e.logprob for e in first.prompt_logprobs[1:]] == pytest.approx(over_http, abs=1e-6)


def test_a_draining_server_answers_503_with_retry_after(daemon):
    # Last in this module: the daemon stays drained.
    daemon.admin.Drain(pb.DrainRequest(), timeout=10)
    reply = httpx.post(f"{daemon.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "1"
    assert reply.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(f"{daemon.http_url}/health").status_code == 503
