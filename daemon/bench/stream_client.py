"""One streaming Generate over gRPC, timed chunk by chunk: the client `tokend bench`, the benchmarks and the chaos
run share, in an asyncio and a blocking flavour over the same record."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


@dataclass(slots=True)
class StreamRecord:
    """What the client saw of one stream. Times are time.monotonic(), comparable across processes on one machine.

    A chunk counts as output when it carries token ids (a usage-only or final chunk does not); the usage and the
    finish reason are the last ones the stream said; an RPC error ends the record with its code and details."""

    sent: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, token ids) of each output chunk
    num_chunks: int = 0  # every chunk that arrived, output or not
    text: str = ""  # the output chunks' text, concatenated
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    migrated: bool = False  # the final chunk's flag: the stream moved to another worker on the way
    generations: list[str] = field(default_factory=list)  # the weights that served it, in order of first sight
    code: grpc.StatusCode | None = None
    error: str | None = None  # "CODE: details" of the RPC error that ended it
    ended: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(count for _, count in self.chunks)

    @property
    def ttft(self) -> float | None:
        """Send to the first output chunk, in seconds; None when no output arrived."""
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def per_token_s(self) -> float | None:
        """The span from the first output token to the last over the tokens between (chunks a slow reader finds
        buffered together do not skew it); None for fewer than two tokens."""
        tokens = self.tokens
        return (self.chunks[-1][0] - self.chunks[0][0]) / (tokens - 1) if tokens > 1 else None

    def take(self, chunk: pb.GenerateResponse) -> None:
        self.num_chunks += 1
        if chunk.token_ids:
            self.chunks.append((time.monotonic(), len(chunk.token_ids)))
            self.text += chunk.text
        self.prompt_tokens = chunk.usage.prompt_tokens
        self.completion_tokens = chunk.usage.completion_tokens
        if chunk.generation and chunk.generation not in self.generations:
            self.generations.append(chunk.generation)
        if chunk.finish_reason:
            self.finish_reason, self.migrated = chunk.finish_reason, chunk.migrated

    def fail(self, error: grpc.RpcError) -> None:
        self.code = error.code()
        self.error = f"{self.code.name}: {error.details()}"


async def stream_generate(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float | None = None, metadata=()
) -> StreamRecord:
    """The stream to its end on a grpc.aio stub; an RPC error is recorded, not raised."""
    record = StreamRecord(sent=time.monotonic())
    try:
        async for chunk in stub.Generate(request, timeout=timeout, metadata=metadata):
            record.take(chunk)
    except grpc.aio.AioRpcError as error:
        record.fail(error)
    record.ended = time.monotonic()
    return record


def stream_generate_blocking(
    stub: pb_grpc.GenerationStub, request: pb.GenerateRequest, timeout: float | None = None, metadata=()
) -> StreamRecord:
    """The same on a blocking stub (a thread per stream)."""
    record = StreamRecord(sent=time.monotonic())
    try:
        for chunk in stub.Generate(request, timeout=timeout, metadata=metadata):
            record.take(chunk)
    except grpc.RpcError as error:
        record.fail(error)
    record.ended = time.monotonic()
    return record


def greedy_request(prompt: list[int], max_tokens: int, model: str = "", **fields) -> pb.GenerateRequest:
    """A greedy, ignore_eos request of `max_tokens` for prompt token ids: what every benchmark sends."""
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return pb.GenerateRequest(model=model, token_ids=pb.TokenIds(ids=prompt), sampling=sampling, **fields)
