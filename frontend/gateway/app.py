"""build_app: the gateway's Starlette application, with its limits, error shape, error funnel and request metrics."""

from __future__ import annotations

import contextlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from common.listening import mark_listening
from frontend.gateway.embedding_route import embeddings_endpoint
from frontend.gateway.error_funnel import ErrorFunnel
from frontend.gateway.errors import OpenAIError
from frontend.gateway.limits import RequestLimits
from frontend.gateway.load_route import load_endpoint
from frontend.gateway.origin_guard import OriginGuard
from frontend.gateway.playground_page import STATIC_DIR, PlaygroundAssets
from frontend.gateway.routes import GatewayRoutes
from frontend.gateway.score_routes import rerank_endpoint, score_endpoint
from frontend.gateway.spec import GatewaySpec
from frontend.gateway.token_routes import detokenize_endpoint, tokenize_endpoint


def build_app(spec: GatewaySpec) -> Starlette:
    routes = GatewayRoutes(spec)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await routes.open()
        mark_listening(spec.listening_path)  # the socket is bound and listening before uvicorn starts us
        yield
        await routes.close()

    def counted(route: str, handler):
        async def endpoint(request: Request) -> Response:
            try:
                response = await handler(request)
            except OpenAIError as error:
                response = error.response()
            except ClientDisconnect:
                routes.http_requests.labels(route, "499").inc()
                raise
            except Exception:
                routes.http_requests.labels(route, "500").inc()
                raise  # to ErrorFunnel, which answers and logs it
            routes.http_requests.labels(route, str(response.status_code)).inc()
            return response

        return endpoint

    async def http_error(request: Request, error: HTTPException) -> Response:
        # Starlette's own refusals (no such route, wrong method) in OpenAI's shape too.
        return OpenAIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}").response()

    score, rerank = score_endpoint(routes), rerank_endpoint(routes)
    return Starlette(
        routes=[
            Route("/v1/completions", counted("/v1/completions", routes.completions), methods=["POST"]),
            Route("/v1/chat/completions", counted("/v1/chat/completions", routes.chat_completions), methods=["POST"]),
            Route("/v1/responses", counted("/v1/responses", routes.responses), methods=["POST"]),
            Route("/v1/embeddings", counted("/v1/embeddings", embeddings_endpoint(routes)), methods=["POST"]),
            Route("/score", counted("/score", score), methods=["POST"]),  # vLLM's paths, with and without /v1
            Route("/v1/score", counted("/v1/score", score), methods=["POST"]),
            Route("/rerank", counted("/rerank", rerank), methods=["POST"]),  # and Jina's and Cohere's
            Route("/v1/rerank", counted("/v1/rerank", rerank), methods=["POST"]),
            Route("/v2/rerank", counted("/v2/rerank", rerank), methods=["POST"]),
            Route("/v1/models", counted("/v1/models", routes.models), methods=["GET"]),
            Route("/v1/models/{model_id:path}", counted("/v1/models/{id}", routes.model), methods=["GET"]),
            Route("/health", counted("/health", routes.health), methods=["GET"]),
            Route("/metrics", routes.metrics, methods=["GET"]),
            Route("/v1/load", counted("/v1/load", load_endpoint(routes)), methods=["GET"]),
            Route("/tokenize", counted("/tokenize", tokenize_endpoint(routes)), methods=["POST"]),
            Route("/detokenize", counted("/detokenize", detokenize_endpoint(routes)), methods=["POST"]),
            Route("/", routes.playground, methods=["GET"]),
            Mount("/static", PlaygroundAssets(directory=STATIC_DIR)),
        ],
        middleware=[
            Middleware(ErrorFunnel),  # first: it also catches what the limits raise
            Middleware(
                RequestLimits,
                max_body_bytes=spec.max_body_bytes,
                max_header_count=spec.max_header_count,
                max_header_bytes=spec.max_header_bytes,
            ),
            Middleware(OriginGuard, listen_host=spec.host),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
