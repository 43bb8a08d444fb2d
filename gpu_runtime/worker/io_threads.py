"""The scheduler's two IO threads: one receives and decodes requests, one encodes and sends outputs.

ZeroMQ sockets are not thread-safe, so each socket lives in exactly one of these threads; the engine
thread only touches the two queues. Serialisation and socket work run while the engine computes (zmq
releases the GIL), as in vLLM's engine core.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from gpu_runtime.ipc.messages import (
    MAX_MESSAGE_BYTES,
    UNSEALED,
    FrontendHello,
    ToFrontend,
    ToScheduler,
    frontend_codec,
    scheduler_codec,
)
from gpu_runtime.ipc.peer_auth import TO_SCHEDULER, PeerAuth, Session
from gpu_runtime.ipc.rejected_messages import FORGED, MALFORMED, RejectedMessages

_POLL_MS = 100  # how often a blocked thread looks at its stop flag (and the writer at its connection)
# While the engine thread is inside one long step (a big prompt chunk on a slow machine can take seconds), the
# writer sends a keep-alive this often, so the frontend does not take a busy scheduler for a stuck one. A stopped
# process (SIGSTOP) sends nothing; an engine stuck inside a step is the daemon's stall watchdog's to kill.
_KEEPALIVE_S = 0.1
# How long a closing writer waits for its last messages to reach a frontend that is still there (a draining worker's
# final deltas). With the frontend gone nothing would take them, and the wait would only delay the exit.
_FLUSH_MS = 1000


class FrontendDisconnected:
    """Put in the engine thread's inbox by the output thread when the frontend's end of the link went away.

    Never on the wire: the inbox's other messages are decoded from the input socket, this one is made here."""


class InputReader(threading.Thread):
    """Binds the scheduler's input socket and queues every valid message; anything else is logged and dropped.

    Nothing a peer sends can stop this thread: any failure to decode (not only DecodeError) drops the message.
    A FrontendHello must carry a genuine proof and a nonce never seen here; it opens the session (`session`) whose
    seal every later frame must carry, with a sequence above the last taken. Anything else (no seal, a forged or
    replayed one, a frame of an earlier session) is dropped as forged, before it is even decoded."""

    def __init__(self, context: zmq.Context, address: str, inbox: queue.Queue, auth: PeerAuth, log, *,
                 worker_id: str, incarnation: str):  # fmt: skip
        super().__init__(name="scheduler-input", daemon=True)
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # zmq drops a sender that goes beyond it
        self._socket.bind(address)  # binding first: a request sent before we listen waits in the sender's queue
        self._inbox = inbox
        self._codec = scheduler_codec()
        self._auth = auth
        self._worker_id = worker_id
        self._incarnation = incarnation  # the SchedulerLoop's: its readies name it, and the session is bound to it
        # The latest genuine hello's session: this thread checks what comes in with it, the output thread seals what
        # goes out (one assignment, so the other thread sees the old session or the new one, never half of one).
        self.session: Session | None = None
        self._nonces: set[bytes] = set()  # of every hello taken (a few per frontend restart)
        self._stopped = threading.Event()
        self._log = log
        self.rejected = RejectedMessages()

    def run(self) -> None:
        while not self._stopped.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            message = self._take(self._socket.recv_multipart(copy=True))
            if message is not None:
                self._inbox.put(message)
        self._socket.close()

    def stop(self) -> None:
        self._stopped.set()

    def _take(self, frames: list[bytes]) -> ToScheduler | None:
        """The message of a genuine frame (or pair of frames); None, counted and logged, for anything else."""
        data = frames[0]
        if len(frames) == 2:
            refused = "no_session" if self.session is None else self.session.receive.check(data, frames[1])
            if refused:
                return self._forged(reason=refused, bytes=len(data))
        elif len(frames) > 2:
            return self._forged(reason="frames", frames=len(frames))
        message = self._decode(data)
        if isinstance(message, FrontendHello):
            return self._greeted(message)
        if message is not None and len(frames) == 1:
            return self._forged(kind=type(message).__name__, reason="unsealed")
        return message

    def _decode(self, data: bytes) -> ToScheduler | None:
        try:
            return self._codec.decode(data)
        except Exception as error:  # RecursionError included (see Codec.decode)
            # Never fall back to another decoder: unchecked bytes are how pickle exploits get in.
            self.rejected.count(MALFORMED)
            self._log.warning(
                "dropped_bad_message", bytes=len(data), error_type=type(error).__name__, error=str(error)[:200]
            )
            return None

    def _greeted(self, hello: FrontendHello) -> FrontendHello | None:
        frontend_id = hello.frontend_id[:64]
        if not self._auth.hello_is_genuine(hello.frontend_id, hello.proof, hello.nonce):
            return self._forged(kind="FrontendHello", reason="bad_proof", frontend_id=frontend_id)
        if hello.nonce in self._nonces:
            return self._forged(kind="FrontendHello", reason="replayed", frontend_id=frontend_id)
        self._nonces.add(hello.nonce)
        self.session = self._auth.session(hello.frontend_id, hello.nonce, self._worker_id, self._incarnation,
                                          receives=TO_SCHEDULER)  # fmt: skip
        return hello

    def _forged(self, **fields) -> None:
        self.rejected.count(FORGED)
        self._log.warning("forged_message", channel=TO_SCHEDULER, **fields)
        return None


class OutputWriter(threading.Thread):
    """Encodes and sends what the engine thread puts in the outbox, in order.

    It also watches its connection to the frontend: when the frontend's end goes away (the frontend binds the
    output socket for its whole life, so that means the process ended), it calls on_disconnect, once per loss;
    and between step_started and step_ended it sends the keep-alive message whenever nothing else went out for
    _KEEPALIVE_S. Every message but a SchedulerReady goes sealed on `session()` (the InputReader's: the latest
    frontend's that said hello), and not at all while there is none: no frontend could take it.
    """

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        log,
        on_disconnect: Callable[[], None] = lambda: None,
        high_water_mark: int = 100_000,
        session: Callable[[], Session | None] = lambda: None,
    ):
        super().__init__(name="scheduler-output", daemon=True)
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._frontend_connected = False
        self._socket.connect(address)
        self._outbox: queue.Queue[ToFrontend | None] = queue.Queue()
        self._codec = frontend_codec()
        self._on_disconnect = on_disconnect
        self._session = session
        self._log = log
        self._keepalive: ToFrontend | None = None  # set by the engine thread while it is inside a step
        self._last_sent = time.monotonic()

    def send(self, message: ToFrontend) -> None:
        self._outbox.put(message)

    def step_started(self, keepalive: ToFrontend) -> None:
        self._keepalive = keepalive

    def step_ended(self) -> None:
        self._keepalive = None

    def run(self) -> None:
        while True:
            try:
                message = self._outbox.get(timeout=_KEEPALIVE_S)
            except queue.Empty:
                self._watch_connection()
                keepalive = self._keepalive
                if keepalive is not None and time.monotonic() - self._last_sent >= _KEEPALIVE_S:
                    self._send(keepalive)
                continue
            if message is None:
                break
            self._watch_connection()
            self._send(message)
        self._watch_connection()
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=_FLUSH_MS if self._frontend_connected else 0)

    def _send(self, message: ToFrontend) -> None:
        self._last_sent = time.monotonic()
        data = self._codec.encode(message)
        if isinstance(message, UNSEALED):
            frames = [data]  # its proof is its seal: a frontend takes it before any session is open
        elif (session := self._session()) is None:
            return  # no frontend said hello yet: none would take it (the load reports start once one has)
        else:
            frames = [data, session.send.seal(data)]
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # The frontend is gone and its queue is full; it fails those requests itself when it returns.
            self._log.warning("dropped_output", kind=type(message).__name__)

    def close(self) -> None:
        """Sends everything queued so far, then stops."""
        self._outbox.put(None)
        self.join(timeout=5)

    def _watch_connection(self) -> None:
        # The monitor socket lives in this thread too; the engine thread hears of a loss through its inbox only.
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            self._frontend_connected = event["event"] == zmq.EVENT_CONNECTED
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._log.warning("frontend_disconnected")
                self._on_disconnect()
