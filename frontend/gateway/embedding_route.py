"""POST /v1/embeddings in OpenAI's shape (vLLM's `normalize` besides): text or token ids, one or many, answered as
float lists or as base64 of little-endian float32 (what the openai client asks for by default), over gRPC Embed."""

from __future__ import annotations

import array
import base64
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.gateway import request_ids
from frontend.gateway.errors import bad_request, from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.openai_requests import decode
from frontend.gateway.routes import GatewayRoutes, _auth_metadata
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

MAX_INPUTS = 2048  # OpenAI's bound (the frontend's too)
_TIMEOUT_S = 600  # a whole batch of long inputs on a busy CPU worker
_UINT32_END = 2**32


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]  # a string, strings, token ids or token id lists (_inputs tells them apart)
    model: str = ""
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used
    normalize: bool | None = None  # vLLM's: unset, as the model's sentence-transformers files say


def embeddings_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def embeddings(request: Request) -> Response:
        body = decode(await request.body(), EmbeddingRequest)
        message = _to_grpc(body, request_ids.of(request))
        stub = pb_grpc.GenerationStub(routes.channel)
        try:
            reply = await stub.Embed(message, metadata=_auth_metadata(request), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            # The frontend names `inputs[i]...`; the body calls it `input` (one string: no index).
            details = re.sub(r"^inputs(\[\d+\])(\.text|\.token_ids)?", r"input\1", error.details() or "")
            if isinstance(body.input, str):
                details = details.replace("input[0]", "input", 1)
            raise from_grpc(error.code(), details, chat=False) from None
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(item.values, body.encoding_format)}
            for index, item in enumerate(reply.embeddings)
        ]
        usage = {"prompt_tokens": reply.usage.prompt_tokens, "total_tokens": reply.usage.prompt_tokens}
        return LineSafeJSONResponse({"id": f"embd-{reply.request_id}", "object": "list", "created": int(time.time()),
                                     "model": reply.model, "data": data, "usage": usage})  # fmt: skip

    return embeddings


def _to_grpc(body: EmbeddingRequest, request_id: str) -> pb.EmbedRequest:
    if body.encoding_format not in ("float", "base64"):
        raise bad_request(f"encoding_format: must be float or base64, got {body.encoding_format!r}", "encoding_format")
    if body.dimensions is not None and not 1 <= body.dimensions < _UINT32_END:
        raise bad_request(f"dimensions: must be an integer >= 1, got {body.dimensions}", "dimensions")
    inputs = _inputs(body.input)
    return pb.EmbedRequest(model=body.model, inputs=inputs, dimensions=body.dimensions, normalize=body.normalize,
                           request_id=request_id)  # fmt: skip


def _inputs(given: str | list) -> list[pb.EmbedInput]:
    """OpenAI's four shapes of `input`: a string, strings, one token list, token lists."""
    if isinstance(given, str):
        return [pb.EmbedInput(text=given)]
    if not given:
        raise bad_request("input: must not be empty", "input")
    if all(_is_token(item) for item in given):  # one list of token ids
        return [_token_input(given, "input")]
    if len(given) > MAX_INPUTS:
        raise bad_request(f"input: at most {MAX_INPUTS} inputs, got {len(given)}", "input")
    if all(isinstance(item, str) for item in given):
        return [pb.EmbedInput(text=text) for text in given]
    if all(isinstance(item, list) and all(_is_token(token) for token in item) for item in given):
        return [_token_input(ids, f"input[{index}]") for index, ids in enumerate(given)]
    raise bad_request("input: must be a string, strings, token ids, or lists of token ids", "input")


def _is_token(item: object) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _token_input(ids: list[int], field: str) -> pb.EmbedInput:
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < _UINT32_END), None)
    if bad is not None:
        raise bad_request(f"{field}: {ids[bad]} at index {bad} is not a token id", field)
    return pb.EmbedInput(token_ids=pb.TokenIds(ids=ids))


def _encoded(values, encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return list(values)
    vector = array.array("f", values)
    if sys.byteorder == "big":
        vector.byteswap()  # the format is little-endian float32 (numpy's "<f4", as the openai client reads it)
    return base64.b64encode(vector.tobytes()).decode("ascii")
