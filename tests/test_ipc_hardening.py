"""No input stops an IPC receiver: deep nests, oversize and forged messages are logged and dropped, in each
receiver on its own and on a running daemon's sockets while a stream goes on."""

from __future__ import annotations

import asyncio
import queue
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from daemon_harness import Daemon

from frontend.scheduler_link import SchedulerLink
from frontend.spec import FrontendSpec, SchedulerAddress
from gpu_runtime import EngineConfig, LLMEngine, SamplingParams
from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import (
    MAX_MESSAGE_BYTES,
    AddRequest,
    FrontendHello,
    KVTransferParams,
    LoadReport,
    RequestDelta,
    SchedulerReady,
    StepOutputs,
    frontend_codec,
    scheduler_codec,
)
from gpu_runtime.ipc.peer_auth import (
    SECRET_FILE,
    TO_FRONTEND,
    TO_SCHEDULER,
    PeerAuth,
    Session,
    read_secret,
    write_secret,
)
from gpu_runtime.worker.io_threads import FrontendDisconnected, InputReader
from gpu_runtime.worker.scheduler_loop import SchedulerLoop
from gpu_runtime.worker.spec import WorkerSpec
from tokend.v1 import tokend_pb2 as pb

DEPTH = 200_000
LONG = pb.SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0)


def deep_before_tag(tag: str, depth: int = DEPTH) -> bytes:
    """A map whose first value is an array nested `depth` deep, then the tagged union's tag: msgspec skips
    what precedes the tag recursively, whatever the schema."""
    nest = b"\x91" * depth + b"\x00"  # fixarray of one element, repeated; then the integer 0
    return b"\x82\xa1x" + nest + b"\xa4type" + msgspec.msgpack.encode(tag)


class RecordingLog:
    """A structlog-shaped logger that keeps (level, event, fields) for the test to read; thread-safe enough."""

    def __init__(self):
        self.records: list[tuple[str, str, dict]] = []

    def events(self, event: str) -> list[dict]:
        return [fields for _, name, fields in list(self.records) if name == event]

    def bind(self, **_):
        return self

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((level, event, fields))


def sealed(codec, session: Session, message) -> list[bytes]:
    """The frames a sender on `session` sends `message` as: the message, then its seal."""
    data = codec.encode(message)
    return [data, session.send.seal(data)]


def wait_until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)
    return value


async def async_wait_until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
    return value


# -- the codec ------------------------------------------------------------------------------------------------


def test_every_message_type_refuses_unknown_fields_and_a_deep_nest_is_not_a_decode_error():
    for struct in (StepOutputs, SchedulerReady, LoadReport, RequestDelta, FrontendHello, AddRequest):
        assert struct.__struct_config__.forbid_unknown_fields, struct.__name__
    ready = {"type": "ready", "worker_id": "w", "incarnation": "i", "pid": 1, "model_name": "m", "model_dir": "/",
             "group": "0", "max_model_len": 8, "vocab_size": 8, "num_pages": 1, "page_size": 1, "max_num_seqs": 1,
             "proof": b""}  # fmt: skip
    frontend_codec().decode(msgspec.msgpack.encode(ready))
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        frontend_codec().decode(msgspec.msgpack.encode({**ready, "extra": 1}))
    # Why receivers catch Exception: schema checks, forbid_unknown_fields included, come after this recursion.
    for codec, tag in ((frontend_codec(), "step"), (scheduler_codec(), "add")):
        with pytest.raises(RecursionError):
            codec.decode(deep_before_tag(tag))


# -- the scheduler's receiver ------------------------------------------------------------------------------------


def test_the_input_reader_drops_deep_oversize_and_forged_messages_and_keeps_reading(tmp_path):
    auth = PeerAuth(read_secret(write_secret(tmp_path)))
    address = f"ipc://{tmp_path}/in.ipc"
    context, log, inbox = zmq.Context(), RecordingLog(), queue.Queue()
    reader = InputReader(context, address, inbox, auth, log, worker_id="m/0", incarnation="i1")
    reader.start()
    codec = scheduler_codec()
    genuine = FrontendHello("f1", auth.hello_proof("f1", b"n1"), b"n1")
    frontend_end = auth.session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND)
    add = AddRequest("r1", [1, 2], SamplingParams(max_tokens=2), Priority.INTERACTIVE)
    try:
        oversize = context.socket(zmq.PUSH)  # zmq drops this sender's connection, and only this one's
        oversize.connect(address)
        oversize.send(b"\x00" * (MAX_MESSAGE_BYTES + 1))
        push = context.socket(zmq.PUSH)
        push.connect(address)
        push.send(deep_before_tag("add"))
        push.send(codec.encode(FrontendHello("f2", b"\x00" * 32, b"n2")))
        push.send(codec.encode(FrontendHello("f1", auth.hello_proof("f2", b"n1"), b"n1")))  # another frontend's proof
        push.send(codec.encode(genuine))
        push.send_multipart(sealed(codec, frontend_end, add))
        received = [inbox.get(timeout=10), inbox.get(timeout=10)]
    finally:
        reader.stop()
        reader.join(timeout=5)
        for socket in (oversize, push):
            socket.close(linger=0)
        context.term()
    assert received == [genuine, add]
    assert inbox.empty()
    assert [r["error_type"] for r in log.events("dropped_bad_message")] == ["RecursionError"]
    assert [r["frontend_id"] for r in log.events("forged_message")] == ["f2", "f1"]


# -- the scheduler's loop ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=TINY_RANDOM_MODEL_NAME, max_num_seqs=4, kv_cache_bytes=16 << 20))


class RecordingOutbox:
    def __init__(self):
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def step_started(self, keepalive) -> None:  # the output thread's keep-alives: none in a recording
        pass

    def step_ended(self) -> None:
        pass

    def deltas(self, request_id: str) -> list[RequestDelta]:
        steps = [m for m in list(self.sent) if isinstance(m, StepOutputs)]
        return [d for m in steps for d in m.deltas if d.request_id == request_id]


def _scheduler_loop(engine, tmp_path):
    """A SchedulerLoop on the engine with in-memory queues in place of its sockets, and what it talks through."""
    auth = PeerAuth(b"k" * 32)
    spec = WorkerSpec(worker_id="m/0", group="0", input_address="ipc://unused", output_address="ipc://unused",
                      heartbeat_path=str(tmp_path / "alive"), secret_path="unused", engine=EngineConfig())  # fmt: skip
    (tmp_path / "alive").touch()
    inbox, outbox, log = queue.Queue(), RecordingOutbox(), RecordingLog()
    return SchedulerLoop(spec, engine, inbox, outbox, auth, log), inbox, outbox, log, auth


def test_the_loop_takes_requests_only_after_a_hello_and_reports_orphans_to_the_next_frontend(engine, tmp_path):
    loop, inbox, outbox, log, auth = _scheduler_loop(engine, tmp_path)
    long = SamplingParams(max_tokens=900, ignore_eos=True, temperature=0)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        inbox.put(AddRequest("early", [1, 2, 3], long, Priority.INTERACTIVE))  # no hello yet: not taken
        inbox.put(FrontendHello("f1", auth.hello_proof("f1")))
        inbox.put(AddRequest("r1", [1, 2, 3], long, Priority.INTERACTIVE))
        wait_until(lambda: len(outbox.deltas("r1")) >= 3)
        inbox.put(FrontendDisconnected())  # what the output thread says when the frontend's end goes away
        wait_until(lambda: log.events("orphans_aborted"))
        generated = sum(len(d.new_token_ids) for d in outbox.deltas("r1"))
        inbox.put(FrontendHello("f2", auth.hello_proof("f2")))
        final = wait_until(lambda: [d for d in outbox.deltas("r1") if d.finished])
    finally:
        loop.stop()
        thread.join(timeout=10)
    assert log.events("dropped_before_hello") == [{"kind": "AddRequest"}]
    assert outbox.deltas("early") == [] and "early" not in engine.unfinished_request_ids()
    assert log.events("orphans_aborted") == [{"reason": "frontend_disconnected", "aborted": 1}]
    # The final counts go to the new frontend right after the ready that answers its hello, and no earlier.
    (delta,) = final
    assert delta.finish_reason is FinishReason.ABORT and delta.num_output_tokens == generated < 900
    readies = [i for i, m in enumerate(outbox.sent) if isinstance(m, SchedulerReady)]
    final_at = next(i for i, m in enumerate(outbox.sent) if isinstance(m, StepOutputs) and delta in m.deltas)
    assert final_at == readies[-1] + 1 and len(readies) == 3  # at start, to f1, to f2
    for ready in (outbox.sent[i] for i in readies):
        assert auth.ready_is_genuine(ready.worker_id, ready.incarnation, ready.proof)


def test_a_request_the_engine_chokes_on_fails_alone(engine, tmp_path, monkeypatch):
    loop, inbox, outbox, log, auth = _scheduler_loop(engine, tmp_path)
    real_add = engine.add_request

    def choking_add(request_id, *args):
        if request_id.startswith("bad"):
            raise TypeError("an engine bug")
        real_add(request_id, *args)

    monkeypatch.setattr(engine, "add_request", choking_add)
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        inbox.put(FrontendHello("f1", auth.hello_proof("f1")))
        for request_id in ("bad1", "bad2", "good"):
            inbox.put(AddRequest(request_id, [1, 2], short, Priority.INTERACTIVE))
        wait_until(lambda: [d for d in outbox.deltas("good") if d.finished])
    finally:
        loop.stop()
        thread.join(timeout=10)
    for request_id in ("bad1", "bad2"):
        (delta,) = outbox.deltas(request_id)
        assert delta.finish_reason is FinishReason.ERROR and "TypeError" in delta.error
    failures = log.events("message_failed")
    assert [f["exc_info"] for f in failures] == [True, False]  # one traceback per kind of failure
    assert sum(len(d.new_token_ids) for d in outbox.deltas("good")) == 3


# -- the frontend's receiver ---------------------------------------------------------------------------------------


def test_the_frontend_receiver_drops_what_it_cannot_trust_and_keeps_receiving(tmp_path):
    secret = read_secret(write_secret(tmp_path))
    auth = PeerAuth(secret)
    spec = FrontendSpec(grpc_port=0, metrics_port=None, output_address=f"ipc://{tmp_path}/out.ipc",
                        schedulers=[SchedulerAddress("m/0", "m", "0", f"ipc://{tmp_path}/in.ipc")], default_model="m",
                        secret_path=str(tmp_path / "peer-secret"))  # fmt: skip
    log, changes, orphans = RecordingLog(), [], []
    codec = frontend_codec()

    sessions: dict[str, Session] = {}  # the scheduler's end of each incarnation's session

    def send_sealed(socket, message):
        return socket.send_multipart(sealed(codec, sessions[message.incarnation], message))

    def ready(incarnation: str, proof: bytes | None = None) -> SchedulerReady:
        proof = auth.ready_proof("m/0", incarnation) if proof is None else proof
        return SchedulerReady("m/0", incarnation, 1, "m", "/m", "0", 64, 32, 8, 4, 4, proof)

    def report(incarnation: str) -> LoadReport:
        return LoadReport("m/0", incarnation, 0, 0, 0, 0.0, 8, 0, 0, 0, 0, 0.0, 0.0, time.time())

    async def scenario():
        context = zmq.asyncio.Context()
        scheduler_in = context.socket(zmq.PULL)
        scheduler_in.bind(f"ipc://{tmp_path}/in.ipc")
        link = SchedulerLink(spec, log, on_change=lambda: changes.append(link.ready_schedulers("m")))
        link.on_orphan_finished = lambda state, delta: orphans.append(delta)
        await link.start()
        out = context.socket(zmq.PUSH)
        out.connect(spec.output_address)
        try:
            hello = scheduler_codec().decode(await scheduler_in.recv())
            assert auth.hello_is_genuine(hello.frontend_id, hello.proof, hello.nonce)
            for incarnation in ("i1", "stale"):
                sessions[incarnation] = auth.session(hello.frontend_id, hello.nonce, "m/0", incarnation,
                                                     receives=TO_SCHEDULER)  # fmt: skip
            await out.send(deep_before_tag("ready"))
            await out.send(codec.encode(ready("forged", proof=b"\x00" * 32)))
            await out.send(codec.encode(ready("i1")))
            await async_wait_until(lambda: link.ready_schedulers("m"))
            (state,) = link.schedulers
            await send_sealed(out, report("stale"))
            link.on_load = lambda state, report: 1 / 0  # a failure while handling a message
            await send_sealed(out, report("i1"))
            await async_wait_until(lambda: log.events("message_failed"))
            final = RequestDelta("of-a-dead-frontend", [], None, FinishReason.ABORT, 5, 7, 0)
            await send_sealed(out, StepOutputs("m/0", "stale", [final]))  # not from the ready incarnation
            await send_sealed(out, StepOutputs("m/0", "i1", [final]))
            await async_wait_until(lambda: orphans)
            return state
        finally:
            link.close()
            context.destroy(linger=0)

    state = asyncio.run(scenario())
    assert [r["error_type"] for r in log.events("dropped_bad_message")] == ["RecursionError"]
    assert [r["kind"] for r in log.events("forged_message")] == ["SchedulerReady"]
    assert state.ready.incarnation == "i1" and state.load.incarnation == "i1"
    assert orphans == [RequestDelta("of-a-dead-frontend", [], None, FinishReason.ABORT, 5, 7, 0)]
    assert [f["error_type"] for f in log.events("message_failed")] == ["ZeroDivisionError"]


# -- a running daemon ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def _rejected(daemon: Daemon, **labels: str) -> dict[str, float]:
    return {
        reason: daemon.metric("tokend:ipc_messages_rejected_total", reason=reason, **labels)
        for reason in ("malformed", "forged")
    }


def test_deep_and_forged_messages_on_a_daemons_sockets_are_dropped_while_a_stream_goes_on(daemon):
    runtime = daemon.runtime_dir()
    (scheduler,) = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
    forged_ready = SchedulerReady(scheduler.worker_id, "f" * 32, 1, "m", "/", "0", 8, 8, 1, 1, 1, b"\x00" * 32)
    forged_hello = FrontendHello("intruder", b"\x00" * 32)
    # Unsealed: it would have the worker pull pages from where the sender says and cache them under a tenant's salt.
    poison = KVTransferParams("intruder", "x", "ipc:///tmp/intruder.ipc", [0], [b"\x00" * 32], 16)
    forged_add = AddRequest("intruder-1", list(range(1, 20)), SamplingParams(max_tokens=2), Priority.INTERACTIVE,
                            cache_salt="victim", kv_transfer_params=poison)  # fmt: skip
    forged_requests = (forged_hello, forged_add)
    with ThreadPoolExecutor(1) as pool:
        call = daemon.generation.Generate(pb.GenerateRequest(prompt="keep going", sampling=LONG), timeout=120)
        first = next(call)
        rest = pool.submit(list, call)
        context = zmq.Context()
        try:
            for name, payloads in (
                ("frontend.ipc", [deep_before_tag("step"), frontend_codec().encode(forged_ready)]),
                ("scheduler-0-0.ipc", [deep_before_tag("add"), *map(scheduler_codec().encode, forged_requests)]),
            ):
                push = context.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 2000)
                push.connect(f"ipc://{runtime / name}")
                for payload in payloads:
                    push.send(payload)
                push.close()
        finally:
            context.term()
        # Counted as they are refused; the schedulers' counts come in their next load report (5 a second).
        rejected = {"malformed": 2, "forged": 3}
        daemon.wait_for(lambda: _rejected(daemon) == rejected, timeout=10)
        assert {receiver: _rejected(daemon, receiver=receiver) for receiver in ("frontend", scheduler.worker_id)} == {
            "frontend": {"malformed": 1, "forged": 1},
            scheduler.worker_id: {"malformed": 1, "forged": 2},
        }
        chunks = [first, *rest.result(timeout=120)]
    dropped = daemon.log_entries("dropped_bad_message", error_type="RecursionError")
    assert sorted(r["process"] for r in dropped) == ["frontend", "scheduler"]
    forged = daemon.log_entries("forged_message")
    assert sorted((r["process"], r["channel"], r["kind"]) for r in forged) == [
        ("frontend", "to_frontend", "SchedulerReady"),
        ("scheduler", "to_scheduler", "AddRequest"),
        ("scheduler", "to_scheduler", "FrontendHello"),
    ]
    # The stream never noticed (it ran to its end, so it was not aborted), and no restart was taken for real: the
    # same scheduler process at the same epoch.
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 1500
    (after,) = daemon.admin.GetLoad(pb.GetLoadRequest(), timeout=10).schedulers
    assert (after.worker_id, after.pid, after.epoch, after.ready) == (scheduler.worker_id, scheduler.pid,
                                                                      scheduler.epoch, True)  # fmt: skip
    assert daemon.generate("still serving", max_tokens=4, ignore_eos=True)[-1].finish_reason == "length"


def test_the_boot_secret_is_readable_by_the_service_user_only_and_on_no_command_line(daemon):
    path = daemon.runtime_dir() / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = read_secret(path)
    pids = daemon.session_pids()
    assert len(pids) >= 4  # the daemon, its frontend, scheduler and gateway
    for pid in pids:
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert secret not in command_line and secret.hex().encode() not in command_line
