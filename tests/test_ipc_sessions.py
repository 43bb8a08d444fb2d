"""Frames after the hello are sealed, both ways, on a session of their own connection: a scheduler's input thread
drops an AddRequest or AbortRequests without a genuine seal (none, a forged one, a replayed frame, a frame of an
earlier connection) and goes on taking the real ones; the frontend's link drops StepOutputs and LoadReports the same
way. In process, over ipc:// sockets, with no scheduler and no model."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest
import zmq
import zmq.asyncio

from frontend.scheduler_link import SchedulerLink
from frontend.spec import FrontendSpec, SchedulerAddress
from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import (
    AbortRequests,
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
from gpu_runtime.ipc.peer_auth import TO_FRONTEND, TO_SCHEDULER, PeerAuth, read_secret, write_secret
from gpu_runtime.ipc.sampling_params import SamplingParams
from gpu_runtime.worker.io_threads import InputReader, OutputWriter

pytestmark = pytest.mark.fast

AUTH = PeerAuth(b"k" * 32)
SAMPLING = SamplingParams(max_tokens=2)


class RecordingLog:
    """A structlog-shaped logger that keeps (event, fields)."""

    def __init__(self):
        self.records: list[tuple[str, dict]] = []

    def events(self, event: str) -> list[dict]:
        return [fields for name, fields in list(self.records) if name == event]

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((event, fields))


def _frames(codec, session, message) -> list[bytes]:
    data = codec.encode(message)
    return [data, session.send.seal(data)]


# -- the seal --------------------------------------------------------------------------------------------------


def test_a_sealed_frame_is_taken_once_and_only_on_its_own_connection_and_direction():
    scheduler = AUTH.session("f1", b"n1", "m/0", "i1", receives=TO_SCHEDULER)
    frontend = AUTH.session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND)
    first, second, third = (frontend.send.seal(f"frame {i}".encode()) for i in range(3))
    assert scheduler.receive.check(b"frame 1", second) is None  # a gap is fine: a full queue may drop a frame
    assert scheduler.receive.check(b"frame 0", first) == "replayed"  # genuine, but behind the last one taken
    assert scheduler.receive.check(b"frame 1", second) == "replayed"
    assert scheduler.receive.check(b"frame 9", third) == "bad_mac"  # another frame under a genuine seal
    assert scheduler.receive.check(b"frame 2", third[:-1]) == "malformed_seal"
    assert scheduler.receive.check(b"frame 2", third) is None
    # Any other connection's key: another nonce (the frontend's previous connection), another scheduler process,
    # another secret; and the other direction (a scheduler's frame reflected back to it).
    for other in (AUTH.session("f1", b"n0", "m/0", "i1", receives=TO_FRONTEND),
                  AUTH.session("f1", b"n1", "m/0", "i0", receives=TO_FRONTEND),
                  PeerAuth(b"x" * 32).session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND),
                  scheduler):  # fmt: skip
        for _ in range(5):  # well past the sequence taken so far
            seal = other.send.seal(b"frame")
        assert scheduler.receive.check(b"frame", seal) == "bad_mac"


def test_a_ready_proof_covers_its_kv_address():
    proof = AUTH.ready_proof("m/0", "i1", "ipc:///run/kv-m-0.ipc")
    assert AUTH.ready_is_genuine("m/0", "i1", proof, "ipc:///run/kv-m-0.ipc")
    assert not AUTH.ready_is_genuine("m/0", "i1", proof, "ipc:///tmp/intruder.ipc")


# -- the scheduler's input thread ----------------------------------------------------------------------------------


def test_a_forged_or_replayed_request_is_dropped_and_logged_and_the_reader_goes_on(tmp_path):
    address = f"ipc://{tmp_path}/in.ipc"
    context, log, inbox = zmq.Context(), RecordingLog(), queue.Queue()
    reader = InputReader(context, address, inbox, AUTH, log, worker_id="m/0", incarnation="i1")
    reader.start()
    codec = scheduler_codec()
    session = AUTH.session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND)  # the frontend's end
    earlier = AUTH.session("f1", b"n0", "m/0", "i1", receives=TO_FRONTEND)  # its previous connection's
    forger = PeerAuth(b"x" * 32).session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND)
    hello = FrontendHello("f1", AUTH.hello_proof("f1", b"n1"), b"n1")
    # What an unsigned AddRequest could do: make the worker pull pages from the sender's address into a victim
    # tenant's cache.
    poison = KVTransferParams("intruder", "x", "ipc:///tmp/intruder.ipc", [0], [b"\x00" * 32], 16)
    poisoned = AddRequest("poisoned", list(range(1, 20)), SAMPLING, Priority.INTERACTIVE, cache_salt="victim",
                          kv_transfer_params=poison)  # fmt: skip
    r1, r2 = (AddRequest(i, [1, 2], SAMPLING, Priority.INTERACTIVE) for i in ("r1", "r2"))
    genuine_r1 = _frames(codec, session, r1)
    push = context.socket(zmq.PUSH)
    try:
        push.connect(address)
        push.send_multipart(_frames(codec, session, r1))  # before any hello: no session to check it with
        push.send(codec.encode(hello))
        push.send(codec.encode(poisoned))  # no seal
        push.send(codec.encode(AbortRequests(["r1"])))
        push.send_multipart(_frames(codec, forger, poisoned))  # sealed without the secret
        push.send_multipart(genuine_r1)
        push.send_multipart(genuine_r1)  # captured and sent again
        push.send_multipart(_frames(codec, earlier, AbortRequests(["r1"])))  # an earlier connection's frame
        push.send(codec.encode(hello))  # a replayed hello opens no session
        push.send_multipart(_frames(codec, session, r2))
        received = [inbox.get(timeout=10) for _ in range(3)]
    finally:
        reader.stop()
        reader.join(timeout=5)
        push.close(linger=0)
        context.term()
    assert received == [hello, r1, r2] and inbox.empty()  # in order, on one connection: nothing else came in
    forged = log.events("forged_message")
    assert [(f.get("kind"), f["reason"]) for f in forged] == [
        (None, "no_session"),
        ("AddRequest", "unsealed"),
        ("AbortRequests", "unsealed"),
        (None, "bad_mac"),
        (None, "replayed"),
        (None, "bad_mac"),
        ("FrontendHello", "replayed"),
    ]
    assert {f["channel"] for f in forged} == {TO_SCHEDULER} and reader.rejected.forged == len(forged)


def test_the_output_thread_seals_on_the_readers_session_and_sends_only_readies_without_one(tmp_path):
    address = f"ipc://{tmp_path}/out.ipc"
    context = zmq.Context()
    frontend = context.socket(zmq.PULL)
    frontend.bind(address)
    sessions = [None]
    writer = OutputWriter(context, address, RecordingLog(), session=lambda: sessions[-1])
    writer.start()
    report = LoadReport("m/0", "i1", 0, 0, 0, 0.0, 8, 0, 0, 0, 0, 0.0, 0.0, 0.0)
    ready = SchedulerReady("m/0", "i1", 1, "m", "/m", "0", 64, 32, 8, 4, 4, AUTH.ready_proof("m/0", "i1"))
    frontend_end = AUTH.session("f1", b"n1", "m/0", "i1", receives=TO_FRONTEND)
    try:
        writer.send(report)  # no hello yet: no frontend could take it
        writer.send(ready)
        first = frontend.recv_multipart()
        sessions.append(AUTH.session("f1", b"n1", "m/0", "i1", receives=TO_SCHEDULER))
        writer.send(report)
        data, seal = frontend.recv_multipart()
    finally:
        writer.close()
        frontend.close(linger=0)
        context.term()
    assert [frontend_codec().decode(frame) for frame in first] == [ready]  # one frame: the ready's proof is its own
    assert frontend_end.receive.check(data, seal) is None and frontend_codec().decode(data) == report


# -- the frontend's link ---------------------------------------------------------------------------------------------


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_the_link_seals_what_it_sends_and_drops_forged_or_replayed_outputs(tmp_path):
    auth = PeerAuth(read_secret(write_secret(tmp_path)))
    spec = FrontendSpec(grpc_port=0, metrics_port=None, output_address=f"ipc://{tmp_path}/out.ipc",
                        schedulers=[SchedulerAddress("m/0", "m", "0", f"ipc://{tmp_path}/in.ipc")], default_model="m",
                        secret_path=str(tmp_path / "peer-secret"))  # fmt: skip
    log = RecordingLog()
    codec = frontend_codec()

    def delta(tokens: list[int], finish: FinishReason | None = None) -> RequestDelta:
        return RequestDelta("r1", tokens, None, finish, 2, 0, 0)

    async def scenario():
        context = zmq.asyncio.Context()
        scheduler_in = context.socket(zmq.PULL)
        scheduler_in.bind(f"ipc://{tmp_path}/in.ipc")
        link = SchedulerLink(spec, log, on_change=lambda: None)
        await link.start()
        out = context.socket(zmq.PUSH)
        out.connect(spec.output_address)
        try:
            hello = scheduler_codec().decode(await scheduler_in.recv())
            session = auth.session(hello.frontend_id, hello.nonce, "m/0", "i1", receives=TO_SCHEDULER)
            forger = PeerAuth(b"x" * 32).session(hello.frontend_id, hello.nonce, "m/0", "i1", receives=TO_SCHEDULER)
            await out.send(codec.encode(SchedulerReady("m/0", "i1", 1, "m", "/m", "0", 64, 32, 8, 4, 4,
                                                       auth.ready_proof("m/0", "i1"))))  # fmt: skip
            await _until(lambda: link.ready_schedulers("m"))
            (state,) = link.schedulers
            stream = link.submit(state, AddRequest("r1", [1, 2], SAMPLING, Priority.INTERACTIVE))
            data, seal = await scheduler_in.recv_multipart()
            assert session.receive.check(data, seal) is None  # what the link sends is sealed on the session
            genuine = _frames(codec, session, StepOutputs("m/0", "i1", [delta([1])]))
            await out.send(codec.encode(StepOutputs("m/0", "i1", [delta([66])])))  # no seal
            await out.send(codec.encode(LoadReport("m/0", "i1", 0, 0, 0, 0.0, 8, 0, 0, 0, 0, 9.0, 0.0, 0.0)))
            await out.send_multipart(_frames(codec, forger, StepOutputs("m/0", "i1", [delta([66])])))
            await out.send_multipart(genuine)
            await out.send_multipart(genuine)  # captured and sent again
            final = StepOutputs("m/0", "i1", [delta([2], FinishReason.LENGTH)])
            await out.send_multipart(_frames(codec, session, final))
            await _until(lambda: stream.finished)
            return [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]
        finally:
            link.close()
            context.destroy(linger=0)

    deltas = asyncio.run(scenario())
    assert [d.new_token_ids for d in deltas] == [[1], [2]]
    forged = log.events("forged_message")
    assert [(f["kind"], f["reason"]) for f in forged] == [
        ("StepOutputs", "unsealed"),
        ("LoadReport", "unsealed"),
        ("StepOutputs", "bad_mac"),
        ("StepOutputs", "replayed"),
    ]
    assert {f["channel"] for f in forged} == {TO_FRONTEND}
