"""vLLM's POST /score (/v1/score) and the Jina/Cohere-shaped POST /rerank (/v1/rerank, /v2/rerank) over gRPC Embed:
a pair's score is the cosine similarity of the two texts' embeddings, as vLLM scores pairs with an embedding model
(a cross-encoder's classifier head is not served here)."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Awaitable, Callable

import grpc
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.gateway import request_ids
from frontend.gateway.embedding_route import MAX_INPUTS
from frontend.gateway.errors import bad_request, from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.openai_requests import decode
from frontend.gateway.routes import GatewayRoutes, _auth_metadata
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_TIMEOUT_S = 600


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str = ""


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str]
    model: str = ""
    top_n: int | None = None  # the best n results; unset: all of them
    return_documents: bool = True


def score_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def score(request: Request) -> Response:
        body = decode(await request.body(), ScoreRequest)
        firsts, seconds = _as_list(body.text_1, "text_1"), _as_list(body.text_2, "text_2")
        fields = _fields_of_texts(body)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)  # one text against each of the others
        elif len(firsts) != len(seconds):
            raise bad_request(f"text_2: {len(seconds)} texts to pair with text_1's {len(firsts)}; give as many, or "
                              "one text_1", "text_2")  # fmt: skip
        reply = await _embed(routes, request, body.model, list(fields), list(fields.values()))
        vectors = dict(zip(fields, reply.embeddings, strict=True))
        data = [{"index": index, "object": "score", "score": _cosine(vectors[a].values, vectors[b].values)}
                for index, (a, b) in enumerate(zip(firsts, seconds, strict=True))]  # fmt: skip
        tokens = reply.usage.prompt_tokens
        return LineSafeJSONResponse({"id": f"score-{reply.request_id}", "object": "list", "created": int(time.time()),
                                     "model": reply.model, "data": data,
                                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip

    return score


def rerank_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def rerank(request: Request) -> Response:
        body = decode(await request.body(), RerankRequest)
        if not 1 <= len(body.documents) < MAX_INPUTS:
            raise bad_request(f"documents: must hold 1 to {MAX_INPUTS - 1} documents, got {len(body.documents)}",
                              "documents")  # fmt: skip
        if body.top_n is not None and body.top_n < 1:
            raise bad_request(f"top_n: must be at least 1, got {body.top_n}", "top_n")
        fields = ["query", *(f"documents[{index}]" for index in range(len(body.documents)))]
        reply = await _embed(routes, request, body.model, [body.query, *body.documents], fields)
        query, *documents = reply.embeddings
        results = [{"index": index, "relevance_score": _cosine(query.values, vector.values)}
                   for index, vector in enumerate(documents)]  # fmt: skip
        results.sort(key=lambda result: -result["relevance_score"])
        results = results[: body.top_n or len(results)]
        if body.return_documents:
            for result in results:
                result["document"] = {"text": body.documents[result["index"]]}
        return LineSafeJSONResponse({"id": f"rerank-{reply.request_id}", "model": reply.model, "results": results,
                                     "usage": {"total_tokens": reply.usage.prompt_tokens}})  # fmt: skip

    return rerank


def _fields_of_texts(body: ScoreRequest) -> dict[str, str]:
    """Each distinct text once (it is embedded once), with the field it first appears in, named in a refusal."""
    fields: dict[str, str] = {}
    for name, texts in (("text_1", body.text_1), ("text_2", body.text_2)):
        if isinstance(texts, str):
            fields.setdefault(texts, name)
        for index, text in enumerate(texts if isinstance(texts, list) else []):
            fields.setdefault(text, f"{name}[{index}]")
    return fields


def _as_list(texts: str | list[str], field: str) -> list[str]:
    texts = [texts] if isinstance(texts, str) else texts
    if not 1 <= len(texts) <= MAX_INPUTS // 2:
        raise bad_request(f"{field}: must hold 1 to {MAX_INPUTS // 2} texts, got {len(texts)}", field)
    return texts


async def _embed(routes: GatewayRoutes, request: Request, model: str, texts: list[str],
                 fields: list[str]) -> pb.EmbedResponse:  # fmt: skip
    """The texts' embeddings, normalized (so that a dot product is their cosine); a refusal names the text's field
    (`fields`, one per text)."""
    message = pb.EmbedRequest(model=model, inputs=[pb.EmbedInput(text=text) for text in texts], normalize=True,
                              request_id=request_ids.of(request))  # fmt: skip
    try:
        return await pb_grpc.GenerationStub(routes.channel).Embed(message, metadata=_auth_metadata(request),
                                                                   timeout=_TIMEOUT_S)  # fmt: skip
    except grpc.aio.AioRpcError as error:
        details = error.details() or ""
        named = re.match(r"^inputs\[(\d+)\](\.text)?", details)
        if named and int(named.group(1)) < len(fields):
            details = fields[int(named.group(1))] + details[named.end() :]
        raise from_grpc(error.code(), details, chat=False) from None


def _cosine(a, b) -> float:
    """Of two unit vectors: their dot product, clamped against float32 rounding."""
    return max(-1.0, min(1.0, math.fsum(x * y for x, y in zip(a, b, strict=True))))
