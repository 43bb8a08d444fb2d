"""The daemon's end of the control channel with the frontend (frontend.control_messages), polled from its loop.

The supervisor is a plain synchronous loop, so this end never blocks: `receive` takes what has arrived, `send`
drops a message when the frontend is not there to take it (it gets the whole current set when it says hello).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq

from frontend.control_messages import DAEMON_SOCKET_FILE, FRONTEND_SOCKET_FILE, ControlCodec, ToDaemon
from gpu_runtime.ipc.messages import MAX_MESSAGE_BYTES
from gpu_runtime.ipc.peer_auth import PeerAuth


class ControlChannel:
    def __init__(self, runtime_dir: Path, secret: bytes, log):
        self._log = log
        self._codec = ControlCodec(PeerAuth(secret), "daemon", ToDaemon)
        self._context = zmq.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._inbox.bind(f"ipc://{runtime_dir}/{DAEMON_SOCKET_FILE}")
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.setsockopt(zmq.SNDHWM, 64)
        self._outbox.connect(f"ipc://{runtime_dir}/{FRONTEND_SOCKET_FILE}")

    def receive(self) -> list[ToDaemon]:
        """Every genuine message that has arrived; forged or undecodable bytes are logged and dropped."""
        messages = []
        while True:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return messages
            message = self._codec.decode_or_drop(data, self._log)
            if message is not None:
                messages.append(message)

    def send(self, message: msgspec.Struct) -> None:
        try:
            self._outbox.send(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # no frontend, or one that does not read: it asks for the whole set when it is back
            self._log.debug("control_message_dropped", kind=type(message).__name__)

    def close(self) -> None:
        self._context.destroy(linger=0)
