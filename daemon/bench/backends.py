"""How a benchmark request reaches the daemon: OpenAI completions or chat completions over HTTP/SSE, or Generate
over gRPC.

All time a request as vLLM's request functions do: start when it is sent, the first token when the first chunk of
generated output arrives (a chunk with choices, even if its text is still empty: a token can decode to nothing
yet; for chat, a delta that carries `content`, so a role-only chunk sent ahead of prefill would not count), one
inter-token latency per later such chunk, the end at the last such chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import grpc
import httpx

from daemon.bench.datasets import BenchRequest
from daemon.bench.stream_client import greedy_request, stream_generate
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

ENDPOINTS = ("completions", "chat")


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


class _Clock:
    """Times one request into its result: send, each chunk of output, the last one."""

    def __init__(self, result: RequestResult):
        self.result = result
        self.started = self.last = result.start_time = time.perf_counter()

    def output_chunk(self) -> None:
        now = time.perf_counter()
        if self.result.ttft == 0.0:
            self.result.ttft = now - self.started
        else:
            self.result.itl.append(now - self.last)
        self.last = now

    def finish(self) -> RequestResult:
        if self.result.ttft == 0.0:
            self.result.error = "no output chunk arrived"
            return self.result
        self.result.latency = self.last - self.started
        self.result.success = True
        return self.result


class OpenAIBackend:
    """`/v1/completions` (the prompt as token ids, or as text when the workload has it) or `/v1/chat/completions`
    (the prompt's text as one user message)."""

    def __init__(self, base_url: str, model: str, api_key: str | None, endpoint: str = "completions"):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: expected one of {ENDPOINTS}, got {endpoint!r}")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=None,
                                         limits=httpx.Limits(max_connections=None))  # fmt: skip
        self._model = model
        self._chat = endpoint == "chat"

    def _body(self, request: BenchRequest) -> dict:
        body = {"model": self._model, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        if self._chat:
            body["messages"] = [{"role": "user", "content": request.prompt_text}]
            body["max_completion_tokens"] = request.output_len
        else:
            body["prompt"] = request.prompt_text if request.prompt_text is not None else request.prompt_token_ids
            body["max_tokens"] = request.output_len
        return body

    async def send(self, request: BenchRequest) -> RequestResult:
        result = RequestResult(prompt_len=len(request.prompt_token_ids))
        path = "/v1/chat/completions" if self._chat else "/v1/completions"
        clock = _Clock(result)
        try:
            async with self._client.stream("POST", path, json=self._body(request)) as reply:
                if reply.status_code != 200:
                    result.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
                    return result
                async for line in reply.aiter_lines():
                    if line.startswith("data: {"):
                        self._read_chunk(json.loads(line[6:]), result, clock)
        except httpx.HTTPError as error:
            result.error = repr(error)
            return result
        return clock.finish()

    def _read_chunk(self, chunk: dict, result: RequestResult, clock: _Clock) -> None:
        if usage := chunk.get("usage"):
            result.output_tokens = usage["completion_tokens"]
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)
        if not (choices := chunk.get("choices")):
            return
        if self._chat:
            delta = choices[0].get("delta") or {}
            if "content" not in delta:
                return
            text = delta["content"]
        else:
            text = choices[0].get("text")
        clock.output_chunk()
        result.generated_text += text or ""

    async def close(self) -> None:
        await self._client.aclose()


class GrpcBackend:
    def __init__(self, address: str, model: str, api_key: str | None):
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._model = model
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()

    async def send(self, request: BenchRequest) -> RequestResult:
        message = greedy_request(
            request.prompt_token_ids,
            request.output_len,
            self._model,
            priority=pb.PRIORITY_INTERACTIVE if request.interactive else pb.PRIORITY_BATCH,
        )
        stream = await stream_generate(self._stub, message, metadata=self._metadata)
        result = RequestResult(prompt_len=len(request.prompt_token_ids), output_tokens=stream.completion_tokens,
                               generated_text=stream.text, start_time=stream.sent)  # fmt: skip
        if stream.error is not None:
            result.error = stream.error
            return result
        if not stream.chunks:
            result.error = "no output chunk arrived"
            return result
        arrivals = [at for at, _ in stream.chunks]
        result.ttft = arrivals[0] - stream.sent
        result.itl = [later - earlier for earlier, later in zip(arrivals, arrivals[1:], strict=False)]
        result.latency = arrivals[-1] - stream.sent
        result.success = True
        return result

    async def close(self) -> None:
        await self._channel.close()
