"""Structured outputs in the frontend: the gRPC StructuredOutput read into the IPC one, and every spec compiled once
before admission, on a worker thread, so that one that cannot be enforced is INVALID_ARGUMENT naming its field
(and the engine's reason) and never a request that fails later.

The engines compile it again for their matchers (each process has its own cache); both caches key by the spec's
canonical form, so a client that sends the same schema each time pays the compile once per process.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from frontend.errors import RequestError
from frontend.metrics import FrontendMetrics
from frontend.spec import TenantSpec
from gpu_runtime.ipc.messages import SchedulerReady
from gpu_runtime.ipc.structured_output import MAX_SPEC_BYTES, GrammarKind, StructuredOutput
from gpu_runtime.structured.compiler import GrammarCompiler, GrammarError
from tokend.v1 import tokend_pb2 as pb

# A compile longer than this is refused (a tenant may be held to less): the frontend's compile threads are shared
# by every client, and the engines pay the same compile again.
DEFAULT_MAX_COMPILE_MS = 500.0
_NUM_THREADS = 2  # as the tokenize pool: one slow compile does not hold up every small one


class StructuredOutputRefused(RequestError):
    """INVALID_ARGUMENT for a structured output, naming sampling.structured_output.<kind>; counted by reason
    (invalid, too_large, too_slow) in tokend:structured_output_rejected."""

    def __init__(self, kind: str, reason: str, message: str):
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message)
        self.kind = kind
        self.reason = reason


def structured_output_of(wire: pb.SamplingParams) -> StructuredOutput | None:
    """The request's StructuredOutput, or None; StructuredOutputRefused names sampling.structured_output.<field>."""
    if not wire.HasField("structured_output"):
        return None
    kind = wire.structured_output.WhichOneof("kind")
    if kind is None:
        raise StructuredOutputRefused("none", "invalid", "sampling.structured_output: set one of json_schema, "
                                      "json_object, regex, choice, grammar")  # fmt: skip
    value = getattr(wire.structured_output, kind)
    size = len(value.encode()) if isinstance(value, str) else 0
    if size > MAX_SPEC_BYTES:  # before copying it anywhere
        raise StructuredOutputRefused(kind, "too_large", f"sampling.structured_output.{kind}: {size} bytes is over "
                                      f"the limit of {MAX_SPEC_BYTES}")  # fmt: skip
    try:
        if kind == "json_object":
            if not value:
                raise ValueError("structured_output.json_object: must be true when set")
            return StructuredOutput.json_object()
        if kind == "choice":
            return StructuredOutput.choice(list(value.choices))
        return StructuredOutput(GrammarKind(kind), value)
    except ValueError as error:  # a choice list over the limit, an empty spec
        raise StructuredOutputRefused(kind, "invalid", f"sampling.{error}") from None


class GrammarChecks:
    """Compiles each request's spec for the model it goes to, within its tenant's limits, and counts it."""

    def __init__(self, metrics: FrontendMetrics):
        self._metrics = metrics
        self._compilers: dict[str, asyncio.Future[GrammarCompiler]] = {}  # by model directory
        self._executor = ThreadPoolExecutor(_NUM_THREADS, thread_name_prefix="grammar")

    async def check(
        self, output: StructuredOutput, model: SchedulerReady, tenant: TenantSpec | None, field: str | None = None
    ) -> None:
        """Raises StructuredOutputRefused naming `field` (default: sampling.structured_output.<kind>)."""
        field = field or f"sampling.{output.field}"
        max_bytes = (tenant.max_structured_output_bytes if tenant else 0) or MAX_SPEC_BYTES
        size = len(output.spec.encode())
        kind = output.kind.value
        if size > max_bytes:
            raise StructuredOutputRefused(kind, "too_large", f"{field}: {size} bytes is over this tenant's limit "
                                          f"of {max_bytes}")  # fmt: skip
        loop = asyncio.get_running_loop()
        try:
            compiler = await self._compiler(model)  # GrammarError where the model cannot be held to a grammar
            hits = compiler.hits
            compiled = await loop.run_in_executor(self._executor, compiler.compile, output)
        except GrammarError as error:
            raise StructuredOutputRefused(kind, "invalid", f"{field}: {error.reason}") from None
        if compiler.hits > hits:
            self._metrics.structured_output_cache_hits.labels(kind).inc()
        else:
            self._metrics.structured_output_compile_seconds.labels(kind).observe(compiled.compile_s)
        max_ms = (tenant.max_grammar_compile_ms if tenant else 0) or DEFAULT_MAX_COMPILE_MS
        if compiled.compile_s * 1000 > max_ms:
            took_ms = compiled.compile_s * 1000
            message = f"{field}: compiling it took {took_ms:.0f} ms, over the limit of {max_ms:g} ms"
            raise StructuredOutputRefused(kind, "too_slow", message)

    def count_refusal(self, refusal: StructuredOutputRefused) -> None:
        self._metrics.structured_output_rejected.labels(refusal.kind, refusal.reason).inc()

    async def _compiler(self, model: SchedulerReady) -> GrammarCompiler:
        """The model's compiler, built once (~0.2 s, on a thread) however many requests ask for it at once."""
        future = self._compilers.get(model.model_dir)
        if future is None:
            loop = asyncio.get_running_loop()
            future = self._compilers[model.model_dir] = loop.run_in_executor(
                self._executor, GrammarCompiler.for_model, model.model_dir, model.vocab_size, list(model.eos_token_ids)
            )
        return await asyncio.shield(future)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
