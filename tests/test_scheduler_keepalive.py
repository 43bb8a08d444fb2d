"""While the engine thread is inside one long step, the scheduler's output thread tells the frontend it is busy
(an empty StepOutputs every 0.1 s when nothing else went out), so a big prompt chunk on a slow machine is not taken
for a stuck scheduler: before this, the first such step after idle decodes outlasted the 2 s liveness timeout and
the frontend failed every request queued behind it with 503 "no live scheduler". Over a real ipc:// socket."""

from __future__ import annotations

import time

import pytest
import structlog
import zmq

from gpu_runtime.ipc.messages import LoadReport, StepOutputs, frontend_codec
from gpu_runtime.ipc.peer_auth import TO_FRONTEND, TO_SCHEDULER, PeerAuth
from gpu_runtime.worker.io_threads import OutputWriter

KEEPALIVE = StepOutputs("model/0", "incarnation", [])
AUTH = PeerAuth(b"k" * 32)


def received(socket: zmq.Socket, seconds: float) -> list:
    """What came in `seconds`, each checked against its seal as the frontend checks it."""
    codec, messages = frontend_codec(), []
    frontend_end = AUTH.session("f1", b"n1", "model/0", "incarnation", receives=TO_FRONTEND)
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if socket.poll(int(left * 1000)):
            data, seal = socket.recv_multipart()
            assert frontend_end.receive.check(data, seal) is None
            messages.append(codec.decode(data))
    return messages


@pytest.fixture
def wired(tmp_path):
    """(an OutputWriter, the frontend's PULL socket it sends to), over ipc://; both closed after the test."""
    context = zmq.Context()
    frontend = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/frontend.ipc"
    frontend.bind(address)
    session = AUTH.session("f1", b"n1", "model/0", "incarnation", receives=TO_SCHEDULER)  # the scheduler's end
    writer = OutputWriter(context, address, structlog.get_logger(), session=lambda: session)
    writer.start()
    yield writer, frontend
    writer.close()
    frontend.close(linger=0)
    context.term()


def test_keepalives_flow_during_a_step_and_stop_after_it(wired):
    writer, frontend = wired
    assert received(frontend, 0.5) == []  # idle: reports come from the loop, nothing from the writer
    writer.step_started(KEEPALIVE)
    during = received(frontend, 1.0)
    writer.step_ended()
    received(frontend, 0.2)  # one may have been on its way
    after = received(frontend, 0.5)
    # Every 0.1 s of a one-second step: the liveness watch (2 s by default) hears from the scheduler throughout.
    assert len(during) >= 3 and all(m == KEEPALIVE for m in during)
    assert after == []


def test_a_step_that_sends_outputs_needs_no_keepalive(wired):
    writer, frontend = wired
    report = LoadReport("model/0", "incarnation", 0, 0, 0, 0.0, 1, 0, 0, 0, 0, 0.0, 1.0, 0.0)
    writer.step_started(KEEPALIVE)
    for _ in range(10):  # the loop's own messages, faster than the keep-alive interval
        writer.send(report)
        time.sleep(0.03)
    writer.step_ended()
    messages = received(frontend, 0.3)
    assert messages.count(report) == 10 and messages.count(KEEPALIVE) <= 1
