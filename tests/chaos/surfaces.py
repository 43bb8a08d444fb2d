"""The fuzzed surfaces, their share of the inputs, and how each input is sent and judged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import zmq
from harness.local_daemon import LocalDaemon
from hypothesis import strategies as st

from chaos import http_answers, http_bodies, http_headers, ipc_fuzz, proto_wire
from chaos.daemon_setup import FUZZ_TENANT, Tenants
from chaos.fuzz_run import Surface
from chaos.grpc_fuzz import GrpcFuzzer
from chaos.grpc_messages import metadata, request_fields
from chaos.http_wire import exchange

# Share of the fuzz inputs per surface, in the order they run: the IPC ones last, since a receiver they break
# takes a restart to mend.
SHARES = {
    "http_completions_body": 0.2,
    "http_chat_body": 0.2,
    "http_headers": 0.15,
    "grpc_messages": 0.2,
    "grpc_raw_bytes": 0.1,
    "ipc_scheduler_input": 0.075,
    "ipc_frontend_output": 0.075,
}
HTTP_SUSPECTS, GRPC_SUSPECTS = ("gateway", "frontend", "scheduler"), ("frontend", "scheduler", "gateway")


def split(total: int) -> dict[str, int]:
    counts = {name: int(total * share) for name, share in SHARES.items()}
    for name in list(SHARES)[: total - sum(counts.values())]:  # the rounding remainder, one each from the first
        counts[name] += 1
    return counts


@contextlib.contextmanager
def surfaces(
    daemon: LocalDaemon, tenants: Tenants, total: int, timeout: float, canary_every: int
) -> Iterator[list[Surface]]:
    """Every surface with its sender, its clients open until exit."""
    grpc_fuzzer = GrpcFuzzer(daemon.address, timeout)
    context = zmq.Context()
    runtime = daemon.runtime_dir()
    scheduler_path = min(str(p) for p in Path(runtime).glob("scheduler-*.ipc"))
    senders = [ipc_fuzz.IpcSender(context, path, timeout) for path in (scheduler_path, str(runtime / "frontend.ipc"))]
    try:
        yield _surfaces(daemon.http_port, tenants, grpc_fuzzer, senders, split(total), canary_every, timeout)
    finally:
        for sender in senders:
            sender.close()
        context.term()
        grpc_fuzzer.close()


def _surfaces(http_port: int, tenants: Tenants, grpc_fuzzer: GrpcFuzzer, senders: list, counts: dict[str, int],
              canary_every: int, timeout: float) -> list[Surface]:  # fmt: skip
    fuzz_key, fuzz_metadata = tenants.keys[FUZZ_TENANT], tenants.metadata(FUZZ_TENANT)
    http = _http_sender(http_port, fuzz_key, timeout)

    def raw_http(raw: http_headers.RawRequest):
        return http_answers.judge(exchange(http_port, raw.data, timeout, raw.half_close), closing_ok=raw.half_close)

    table = [  # name, strategy, sender, suspects, family
        ("http_completions_body", http_bodies.body_bytes(http_bodies.completion_request),
         lambda body: http(b"/v1/completions", body), HTTP_SUSPECTS, None),
        ("http_chat_body", http_bodies.body_bytes(http_bodies.chat_request),
         lambda body: http(b"/v1/chat/completions", body), HTTP_SUSPECTS, None),
        ("http_headers", http_headers.raw_requests(fuzz_key), raw_http, HTTP_SUSPECTS, None),
        ("grpc_messages", st.tuples(request_fields, metadata(fuzz_key)), grpc_fuzzer.send_message, GRPC_SUSPECTS,
         None),
        ("grpc_raw_bytes", proto_wire.raw_call, lambda call: grpc_fuzzer.send_raw(call, fuzz_metadata),
         GRPC_SUSPECTS, None),
        ("ipc_scheduler_input", ipc_fuzz.ipc_payload, senders[0].send, ("scheduler", "frontend", "gateway"),
         ipc_fuzz.family),
        ("ipc_frontend_output", ipc_fuzz.ipc_payload, senders[1].send, ("frontend", "scheduler", "gateway"),
         ipc_fuzz.family),
    ]  # fmt: skip
    built = []
    for name, strategy, send, suspects, family in table:
        every = max(1, canary_every // 4) if name.startswith("ipc") else canary_every  # IPC inputs answer nothing
        extra = {"family": family} if family else {}
        built.append(Surface(name, strategy, send, counts[name], every, suspects, **extra))
    return built


def _http_sender(port: int, fuzz_key: str, timeout: float):
    """POSTs a body with well-formed headers (the fuzz tenant's key) and judges the answer."""

    def send(path: bytes, body: bytes):
        head = (
            b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n"
        ) % (path, fuzz_key.encode(), len(body))
        return http_answers.judge(exchange(port, head + body, timeout))

    return send
