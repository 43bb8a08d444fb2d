"""The fuzzed surfaces, their share of the inputs, and how each input is sent and judged."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import zmq
from harness.local_daemon import LocalDaemon
from hypothesis import strategies as st

from chaos import control_fuzz, http_answers, http_bodies, http_headers, ipc_fuzz, kv_fuzz, proto_wire
from chaos.daemon_setup import FUZZ_TENANT, Tenants
from chaos.fuzz_run import Surface
from chaos.gguf_fuzz import GgufReader, gguf_file
from chaos.grpc_fuzz import GrpcFuzzer
from chaos.grpc_messages import metadata, request_fields
from chaos.http_wire import exchange
from chaos.rollout_fuzz import RolloutProbe, make_roots, rollout_case

# Share of the fuzz inputs per surface, in the order they run: the IPC ones last, since a receiver they break
# takes a restart to mend. The hardened surfaces (hardened_audit.HARDENED) get at least one input each; kv_socket
# runs only where the daemon has a prefill worker (--pd).
SHARES = {
    "http_completions_body": 0.19,
    "http_chat_body": 0.19,
    "http_headers": 0.14,
    "grpc_messages": 0.19,
    "grpc_raw_bytes": 0.09,
    "rollout_paths": 0.01,
    "gguf_files": 0.02,
    "kv_socket": 0.03,
    "control_channel": 0.02,
    "ipc_scheduler_input": 0.06,
    "ipc_frontend_output": 0.06,
}
_AT_LEAST_ONE = ("rollout_paths", "gguf_files", "kv_socket", "control_channel")
HTTP_SUSPECTS, GRPC_SUSPECTS = ("gateway", "frontend", "scheduler"), ("frontend", "scheduler", "gateway")


def split(total: int, kv: bool = False) -> dict[str, int]:
    shares = {name: share for name, share in SHARES.items() if kv or name != "kv_socket"}
    scale = sum(shares.values())
    counts = {name: int(total * share / scale) for name, share in shares.items()}
    for name in list(shares)[: total - sum(counts.values())]:  # the rounding remainder, one each from the first
        counts[name] += 1
    for name in (n for n in _AT_LEAST_ONE if n in counts and counts[n] == 0):
        largest = max(counts, key=counts.get)
        if counts[largest] > 1:
            counts[largest] -= 1
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
    with contextlib.ExitStack() as stack:
        stack.callback(context.term)
        stack.callback(grpc_fuzzer.close)
        for sender in senders:
            stack.callback(sender.close)
        hardened = _hardened(daemon, tenants, context, timeout, stack)
        counts = split(total, kv=any(row[0] == "kv_socket" for row in hardened))
        yield _surfaces(daemon.http_port, tenants, grpc_fuzzer, senders, hardened, counts, canary_every, timeout)


def _hardened(daemon: LocalDaemon, tenants: Tenants, context: zmq.Context, timeout: float,
              stack: contextlib.ExitStack) -> list[tuple]:  # fmt: skip
    """The surfaces hardened in issue 43, as table rows; kv_socket only where the daemon has a prefill worker."""
    runtime = daemon.runtime_dir()
    roots = make_roots(getattr(daemon, "chaos_dir", Path(daemon.state_dir)))
    probe = RolloutProbe(daemon.address, daemon.state_dir, roots, tenants.keys[FUZZ_TENANT], timeout)
    reader, control = GgufReader(), control_fuzz.ControlSender(context, runtime, timeout)
    for closing in (probe, reader, control):
        stack.callback(closing.close)
    rows = [
        ("rollout_paths", rollout_case, probe.send, GRPC_SUSPECTS, None),
        ("gguf_files", gguf_file, reader.send, GRPC_SUSPECTS, None),  # in process: a failed canary is not its
    ]
    kv_path = kv_fuzz.kv_socket(runtime)
    if kv_path is not None:
        kv = kv_fuzz.KvSender(context, kv_path, timeout)
        stack.callback(kv.close)
        leases = kv_fuzz.lease_ids_in(daemon.log_entries("request_admitted"))
        rows.append(("kv_socket", kv_fuzz.kv_request(leases), kv.send, ("scheduler", "frontend"), None))
    rows.append(("control_channel", control_fuzz.control_input, control.send, ("frontend", "scheduler"),
                 control_fuzz.family))  # fmt: skip
    return rows


def _surfaces(http_port: int, tenants: Tenants, grpc_fuzzer: GrpcFuzzer, senders: list, hardened: list[tuple],
              counts: dict[str, int], canary_every: int, timeout: float) -> list[Surface]:  # fmt: skip
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
        *hardened,
        ("ipc_scheduler_input", ipc_fuzz.ipc_payload, senders[0].send, ("scheduler", "frontend", "gateway"),
         ipc_fuzz.family),
        ("ipc_frontend_output", ipc_fuzz.ipc_payload, senders[1].send, ("frontend", "scheduler", "gateway"),
         ipc_fuzz.family),
    ]  # fmt: skip
    built = []
    for name, strategy, send, suspects, family in table:
        # Inputs that answer nothing get canaries more often.
        every = max(1, canary_every // 4) if name.startswith(("ipc", "control", "kv")) else canary_every
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
