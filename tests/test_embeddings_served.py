"""Embeddings from a real `tokend serve`, through the official `openai` client and gRPC Embed: a model saved by
sentence-transformers answers what its encode does (both encodings), a generating model embeds and chats at once,
every input is metered as prompt tokens, /v1/models says what each model serves, /score and /rerank are the
embeddings' cosines, and bad inputs get a 400 naming the field while a stream beside them goes on."""

from __future__ import annotations

import array
import base64
import threading

import httpx
import openai
import pytest
import torch
from checkpoints import QWEN3, write_sentence_transformer
from daemon_harness import Daemon

from gpu_runtime import LLM
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 3, "ü€ unicode ✓", "a"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    return write_sentence_transformer(tmp_path_factory.mktemp("st-embed"), QWEN3, "mean")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, st_model):
    config = tmp_path_factory.mktemp("embeddings") / "tokend.toml"
    config.write_text(
        f"""
[[models]]
name = "tiny"
path = "{TINY_RANDOM_MODEL_NAME}"

[[models]]
name = "st-embed"
path = "{st_model}"
"""
    )
    with Daemon("--config", str(config)) as running:
        yield running


@pytest.fixture(scope="module")
def client(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _ledger(daemon: Daemon, request_id: str) -> list[dict]:
    """The usage rows of a request's inputs (`<id>-<index>`, or the id itself for one input), in input order."""
    with daemon.ledger() as db:
        rows = [dict(row) for row in db.execute("SELECT * FROM usage WHERE request_id = ? OR request_id LIKE ?",
                                                (request_id, f"{request_id}-%"))]  # fmt: skip
    return sorted(rows, key=lambda row: int(row["request_id"].rpartition("-")[2] or 0))


def test_a_sentence_transformers_model_answers_as_its_encode_in_both_encodings(daemon, client, st_model):
    from sentence_transformers import SentenceTransformer

    expected = SentenceTransformer(str(st_model), device="cpu").encode(TEXTS, batch_size=1, convert_to_tensor=True)
    as_floats = client.embeddings.create(model="st-embed", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.with_raw_response.create(model="st-embed", input=TEXTS, encoding_format="base64")
    raw = as_base64.http_response.json()
    decoded = [array.array("f", base64.b64decode(item["embedding"])).tolist() for item in raw["data"]]
    default = client.embeddings.create(model="st-embed", input=TEXTS)  # the client asks for base64 and decodes it
    for response in (as_floats, default):
        got = torch.tensor([item.embedding for item in response.data])
        assert [item.index for item in response.data] == list(range(len(TEXTS)))
        assert (got - expected).abs().max().item() < TOLERANCE
    # Two requests, batched apart: equal up to float32 summation order.
    assert torch.allclose(torch.tensor(decoded), torch.tensor([i.embedding for i in as_floats.data]), atol=1e-6)
    tokenized = daemon.generation.Tokenize(pb.GenerateRequest(model="st-embed", prompt=TEXTS[1]), timeout=10)
    rows = _ledger(daemon, raw["id"].removeprefix("embd-"))
    assert [row["prompt_tokens"] for row in rows][1] == len(tokenized.token_ids)
    assert sum(row["prompt_tokens"] for row in rows) == as_floats.usage.prompt_tokens == raw["usage"]["total_tokens"]
    assert {row["status"] for row in rows} == {"finished"} and {row["completion_tokens"] for row in rows} == {0}


def test_one_model_chats_and_embeds_at_once_and_both_are_metered(daemon, client):
    token_inputs = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(24)]
    with LLM(TINY_RANDOM_MODEL_NAME) as llm:
        offline = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": ids} for ids in token_inputs])]
    chats: list = []

    def chat(index: int) -> None:
        chats.append(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=40, extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": f"chat-beside-embeddings-{index}"}))  # fmt: skip

    threads = [threading.Thread(target=chat, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    reply = daemon.generation.Embed(pb.EmbedRequest(model="tiny", request_id="grpc-embed", inputs=[
        pb.EmbedInput(token_ids=pb.TokenIds(ids=ids)) for ids in token_inputs]), timeout=120)  # fmt: skip
    for thread in threads:
        thread.join(120)
    got = torch.tensor([list(item.values) for item in reply.embeddings])
    assert (got - torch.tensor(offline)).abs().max().item() < 1e-5
    assert reply.usage.prompt_tokens == sum(map(len, token_inputs)) and reply.generation
    assert [len(c.choices[0].message.content) > 0 for c in chats] == [True] * 3
    rows = _ledger(daemon, "grpc-embed")
    assert [row["prompt_tokens"] for row in rows] == [len(ids) for ids in token_inputs]
    with daemon.ledger() as db:
        chat_rows = db.execute("SELECT completion_tokens FROM usage WHERE request_id LIKE 'chat-beside-embeddings-%'")
        assert [row["completion_tokens"] for row in chat_rows] == [40] * 3


def test_models_say_what_each_serves(client, daemon):
    models = {m["id"]: m for m in httpx.get(f"{daemon.http_url}/v1/models", timeout=10).json()["data"]}
    embed, tiny = models["st-embed"], models["tiny"]
    assert (embed["generates"], embed["pooling"], embed["embedding_size"]) == (False, "mean", 64)
    assert (tiny["generates"], tiny["pooling"], tiny["embedding_size"]) == (True, "last", 128)
    assert embed["matryoshka_dimensions"] == tiny["matryoshka_dimensions"] == []
    assert client.models.retrieve("st-embed").model_dump()["pooling"] == "mean"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "st-embed", "input": []}, "input", "must not be empty"),
        ({"model": "st-embed", "input": ["x"] * 10_000}, "input", "at most 2048 inputs"),
        ({"model": "st-embed", "input": [[5, 6], [7, 999]]}, "input[1]", "id 999 at index 1 is outside the vocabulary"),
        ({"model": "st-embed", "input": [[5, -1]]}, "input[0]", "-1 at index 1 is not a token id"),
        ({"model": "st-embed", "input": ["ok", ""]}, "input[1]", "must not be empty"),
        ({"model": "st-embed", "input": "x", "dimensions": 16}, "dimensions", "does not support matryoshka"),
        ({"model": "st-embed", "input": "x", "encoding_format": "int8"}, "encoding_format", "float or base64"),
        ({"model": "st-embed", "input": 5}, "input", "Expected `str | array`"),
        ({"model": "nope", "input": "x"}, "model", "nope"),
    ],
    ids=["empty", "10k", "out-of-vocab", "negative", "empty-text", "dimensions", "encoding", "type", "model"],
)
def test_bad_inputs_get_a_400_naming_the_field_while_a_stream_goes_on(daemon, body, param, words):
    stream = daemon.generation.Generate(pb.GenerateRequest(model="tiny", prompt="go on", sampling=pb.SamplingParams(
        max_tokens=30, ignore_eos=True)), timeout=60)  # fmt: skip
    response = httpx.post(f"{daemon.http_url}/v1/embeddings", json=body, timeout=30)
    error = response.json().get("error")
    assert response.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param and words in error["message"]
    assert sum(len(chunk.token_ids) for chunk in stream) == 30


def test_a_model_that_only_embeds_refuses_chat_naming_the_model(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="st-embed", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert refused.value.body["param"] == "model" and "serves embeddings only" in refused.value.body["message"]


def test_score_and_rerank_are_the_cosines_of_the_embeddings(daemon, st_model):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(st_model), device="cpu")
    query, documents = TEXTS[0], TEXTS[1:]
    vectors = model.encode([query, *documents], batch_size=1, convert_to_tensor=True)
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:])
    scored = httpx.post(f"{daemon.http_url}/v1/score", json={"model": "st-embed", "text_1": query,
                                                            "text_2": documents}, timeout=60).json()  # fmt: skip
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected.tolist(), abs=TOLERANCE)
    pairwise = httpx.post(f"{daemon.http_url}/score", json={"model": "st-embed", "text_1": documents,
                                                           "text_2": documents}, timeout=60).json()  # fmt: skip
    assert [item["score"] for item in pairwise["data"]] == pytest.approx([1.0] * len(documents), abs=TOLERANCE)
    ranked = httpx.post(f"{daemon.http_url}/rerank", json={"model": "st-embed", "query": query, "documents": documents,
                                                          "top_n": 2}, timeout=60).json()  # fmt: skip
    order = expected.argsort(descending=True).tolist()[:2]
    assert [result["index"] for result in ranked["results"]] == order
    assert [result["document"]["text"] for result in ranked["results"]] == [documents[i] for i in order]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(expected[order].tolist(), abs=TOLERANCE)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/v1/score", {"text_1": "a", "text_2": ["c", ""]}, "text_2[1]"),
        ("/v1/rerank", {"query": "", "documents": ["c"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["c", ""]}, "documents[1]"),
    ],
)
def test_bad_score_and_rerank_bodies_name_the_field(daemon, path, body, param):
    response = httpx.post(f"{daemon.http_url}{path}", json={"model": "st-embed", **body}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
