"""The scheduler's two IO threads: one receives and decodes requests, one encodes and sends outputs.

ZeroMQ sockets are not thread-safe, so each socket lives in exactly one of these threads; the engine
thread only touches the two queues. Serialisation and socket work run while the engine computes (zmq
releases the GIL), as in vLLM's engine core.
"""

from __future__ import annotations

import queue
import threading

import msgspec
import zmq

from gpu_runtime.ipc.messages import ToFrontend, ToScheduler, frontend_codec, scheduler_codec

_POLL_MS = 100  # how often a blocked thread looks at its stop flag


class InputReader(threading.Thread):
    """Binds the scheduler's input socket and queues every valid message; anything else is logged and dropped."""

    def __init__(self, context: zmq.Context, address: str, inbox: queue.Queue[ToScheduler], log):
        super().__init__(name="scheduler-input", daemon=True)
        self._socket = context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)  # binding first: a request sent before we listen waits in the sender's queue
        self._inbox = inbox
        self._codec = scheduler_codec()
        self._stopped = threading.Event()
        self._log = log
        self.num_dropped = 0

    def run(self) -> None:
        while not self._stopped.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            data = self._socket.recv(copy=True)
            try:
                self._inbox.put(self._codec.decode(data))
            except msgspec.DecodeError as error:
                # Never fall back to another decoder: unchecked bytes are how pickle exploits get in.
                self.num_dropped += 1
                self._log.warning("dropped_bad_message", bytes=len(data), error=str(error)[:200])
        self._socket.close()

    def stop(self) -> None:
        self._stopped.set()


class OutputWriter(threading.Thread):
    """Encodes and sends what the engine thread puts in the outbox, in order."""

    def __init__(self, context: zmq.Context, address: str, log, high_water_mark: int = 100_000):
        super().__init__(name="scheduler-output", daemon=True)
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 1000)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.connect(address)
        self._outbox: queue.Queue[ToFrontend | None] = queue.Queue()
        self._codec = frontend_codec()
        self._log = log

    def send(self, message: ToFrontend) -> None:
        self._outbox.put(message)

    def run(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._socket.send(self._codec.encode(message), zmq.NOBLOCK)
            except zmq.Again:
                # The frontend is gone and its queue is full; it fails those requests itself when it returns.
                self._log.warning("dropped_output", kind=type(message).__name__)
        self._socket.close()

    def close(self) -> None:
        """Sends everything queued so far, then stops."""
        self._outbox.put(None)
        self.join(timeout=5)
