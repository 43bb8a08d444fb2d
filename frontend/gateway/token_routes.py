"""POST /tokenize and /detokenize, in vLLM's shapes: a prompt (text, or chat messages rendered with the model's
template) as the model's token ids, and token ids back to text. The frontend tokenizes exactly as it does for
generation (Generation.Tokenize takes the same request), so the count is the one a completion would be billed."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import grpc
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from frontend.gateway.errors import bad_request, from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.openai_requests import ChatMessage, chat_message, decode
from frontend.gateway.routes import GatewayRoutes, _auth_metadata
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_TIMEOUT_S = 30  # a long prompt's tokenization, on the frontend's worker threads


class TokenizeBody(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's default: true for a prompt, false for messages (the template's)
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeBody(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str = ""


def tokenize_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def tokenize(request: Request) -> Response:
        body = decode(await request.body(), TokenizeBody)
        stub = pb_grpc.GenerationStub(routes.channel)
        try:
            reply = await stub.Tokenize(_to_grpc(body), metadata=_auth_metadata(request), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), chat=False) from None
        tokens = list(reply.token_ids)
        return LineSafeJSONResponse({"count": len(tokens), "max_model_len": reply.max_model_len, "tokens": tokens})

    return tokenize


def detokenize_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    async def detokenize(request: Request) -> Response:
        body = decode(await request.body(), DetokenizeBody)
        negative = next((i for i, token in enumerate(body.tokens) if token < 0), None)
        if negative is not None:
            raise bad_request(f"tokens[{negative}]: {body.tokens[negative]} is not a token id", f"tokens[{negative}]")
        stub = pb_grpc.GenerationStub(routes.channel)
        try:
            message = pb.DetokenizeRequest(model=body.model, token_ids=body.tokens)
            reply = await stub.Detokenize(message, metadata=_auth_metadata(request), timeout=_TIMEOUT_S)
        except (ValueError, OverflowError):  # an id past uint32: the message itself cannot hold it
            raise bad_request("tokens: every id must be below the vocabulary size", "tokens") from None
        except grpc.aio.AioRpcError as error:
            details = re.sub(r"^token_ids\b", "tokens", error.details() or "")  # the field as this body names it
            raise from_grpc(error.code(), details, chat=False) from None
        return LineSafeJSONResponse({"prompt": reply.text})

    return detokenize


def _to_grpc(body: TokenizeBody) -> pb.GenerateRequest:
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give prompt or messages (one of them)", "prompt")
    if body.prompt is not None:
        if body.add_special_tokens is False:
            raise bad_request("add_special_tokens: false is not supported for a prompt", "add_special_tokens")
        return pb.GenerateRequest(model=body.model, prompt=body.prompt)
    if body.add_special_tokens:
        field = "add_special_tokens"
        raise bad_request(f"{field}: messages are tokenized as the chat template writes them", field)
    kwargs = body.chat_template_kwargs
    chat = pb.ChatMessages(
        messages=[chat_message(m, index) for index, m in enumerate(body.messages)],
        add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        template_kwargs_json=msgspec.json.encode(kwargs).decode() if kwargs else "",
    )
    return pb.GenerateRequest(model=body.model, chat=chat)
