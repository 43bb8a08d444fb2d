"""How a benchmark request reaches the daemon: OpenAI completions over HTTP/SSE, or Generate over gRPC.

Both time a request the same way: start when it is sent, the first token when the first chunk of generated
output arrives (a chunk with choices, even if its text is still empty, as vLLM's client counts it: a token can
decode to nothing yet), one inter-token latency per later such chunk, the end at the last byte.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from daemon.bench.datasets import BenchRequest
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


class _Clock:
    """Times one request into its result: send, each chunk of output, the end."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.started = self.last = time.perf_counter()

    def output_chunk(self) -> None:
        now = time.perf_counter()
        if self.result.ttft == 0.0:
            self.result.ttft = now - self.started
        else:
            self.result.itl.append(now - self.last)
        self.last = now

    def finish(self) -> RequestResult:
        self.result.latency = time.perf_counter() - self.started
        self.result.success = True
        return self.result


class OpenAIBackend:
    def __init__(self, base_url: str, model: str, api_key: str | None):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=None,
                                         limits=httpx.Limits(max_connections=None))  # fmt: skip
        self._model = model

    async def send(self, request: BenchRequest) -> RequestResult:
        body = {
            "model": self._model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = RequestResult(prompt_len=len(request.prompt_token_ids))
        clock = _Clock(result)
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as reply:
                if reply.status_code != 200:
                    result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                    return result
                async for line in reply.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        result.output_tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        clock.output_chunk()
        except httpx.HTTPError as error:
            result.error = repr(error)
            return result
        return clock.finish()

    async def close(self) -> None:
        await self._client.aclose()


class GrpcBackend:
    def __init__(self, address: str, model: str, api_key: str | None):
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._model = model
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(self, request: BenchRequest) -> RequestResult:
        message = pb.GenerateRequest(
            model=self._model,
            token_ids=pb.TokenIds(ids=request.prompt_token_ids),
            sampling=pb.SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True),
            priority=pb.PRIORITY_INTERACTIVE if request.interactive else pb.PRIORITY_BATCH,
        )
        result = RequestResult(prompt_len=len(request.prompt_token_ids))
        clock = _Clock(result)
        try:
            async for chunk in self._stub.Generate(message, metadata=self._metadata):
                result.output_tokens = chunk.usage.completion_tokens
                if chunk.token_ids:
                    clock.output_chunk()
        except grpc.aio.AioRpcError as error:
            result.error = f"{error.code().name}: {error.details()}"
            return result
        return clock.finish()

    async def close(self) -> None:
        await self._channel.close()
