"""The frontend's end of the control channel with the daemon (frontend.control_messages).

It applies every WorkerSet to the scheduler link as it arrives, hands SIGHUP's tenants to `on_tenants` (a newer
version only, acknowledged), sends operators' rollout commands on, each answered by the daemon's CommandResult, and
tells the daemon which workers it has a live link to (LiveLinks).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from common.lanes import Pool
from frontend.control_messages import (
    CommandResult,
    ControlCodec,
    ControlHello,
    LiveLinks,
    RolloutCommand,
    RolloutStatus,
    ScaleCommand,
    TenantsApplied,
    TenantsUpdate,
    ToFrontend,
    WorkerSet,
)
from frontend.scheduler_link import SchedulerLink
from frontend.spec import TenantSpec
from gpu_runtime.ipc.messages import MAX_MESSAGE_BYTES
from gpu_runtime.ipc.peer_auth import PeerAuth

_COMMAND_TIMEOUT_S = 10.0
_LINKS_RESEND_S = 1.0


class DaemonUnreachable(Exception):
    pass


class ControlLink:
    def __init__(self, link: SchedulerLink, control_address: str, daemon_address: str, secret: bytes, log):
        self._link = link
        self._log = log
        # It speaks first (the hello names it), so it takes only what the daemon addresses to it.
        self._codec = ControlCodec(PeerAuth(secret), "frontend", ToFrontend, addressed_only=True)
        self._tenants_version = 0  # the spec's tenants are the configuration's own: version 0
        self._context = zmq.asyncio.Context()
        self._inbox = self._context.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._inbox.bind(control_address)
        self._outbox = self._context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.connect(daemon_address)
        self._pending: dict[str, asyncio.Future[CommandResult]] = {}
        self._links_sent: list[str] | None = None  # the LiveLinks last sent
        self._links_task: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self.on_tenants: Callable[[list[TenantSpec]], None] = lambda tenants: None

    @property
    def rollouts(self) -> list[RolloutStatus]:
        return list(self._link.worker_set.rollouts.values())

    async def start(self) -> None:
        self._task = asyncio.create_task(self._receive_forever(), name="daemon-control")
        await self._outbox.send(self._codec.encode(ControlHello(self._codec.boot)))
        self._links_task = asyncio.create_task(self._resend_links_forever(), name="live-links")

    def close(self) -> None:
        for task in (self._task, self._links_task):
            if task is not None:
                task.cancel()
        self._context.destroy(linger=0)

    async def _resend_links_forever(self) -> None:
        """The live set again every second: a rollout waiting on a new worker's link moves on even if the message
        that named it was lost (the daemon's set does not change while it waits, so no WorkerSet would prompt it)."""
        while True:
            await asyncio.sleep(_LINKS_RESEND_S)
            self.links_changed(resend=True)

    def links_changed(self, resend: bool = False) -> None:
        """Tells the daemon which workers this frontend has a live link to, when that changed (or `resend`: with
        every WorkerSet, so that one message lost on the way is made good by the next change the daemon makes)."""
        live = sorted(s.address.worker_id for s in self._link.schedulers if s.is_live)
        if live == self._links_sent and not resend:
            return
        self._links_sent = live
        sent = self._outbox.send(self._codec.encode(LiveLinks(live)), zmq.NOBLOCK)  # done at once, or queued
        if sent.done() and sent.exception() is not None:
            self._log.warning("live_links_dropped", detail="the daemon does not read its socket")

    async def scale(self, model_name: str, serving: int, standby: int, reason: str, pool: Pool = Pool.ROUTED) -> None:
        """The autoscaler's decision for one pool, to the daemon (no answer: the next WorkerSet shows what it did)."""
        command = ScaleCommand(model_name, serving, standby, reason, pool)
        try:
            await self._outbox.send(self._codec.encode(command), zmq.NOBLOCK)
        except zmq.Again:
            self._log.warning("scale_command_dropped", model=model_name, detail="the daemon does not read its socket")

    async def rollout(self, command: RolloutCommand) -> CommandResult:
        """The daemon's answer; DaemonUnreachable if none comes in time."""
        future = asyncio.get_running_loop().create_future()
        self._pending[command.command_id] = future
        try:
            await self._outbox.send(self._codec.encode(command), zmq.NOBLOCK)
            return await asyncio.wait_for(future, _COMMAND_TIMEOUT_S)
        except (zmq.Again, TimeoutError):
            raise DaemonUnreachable("the daemon did not answer; retry") from None
        finally:
            self._pending.pop(command.command_id, None)

    async def _receive_forever(self) -> None:
        while True:
            data = await self._inbox.recv()
            message = self._codec.decode_or_drop(data, self._log)
            if message is None:
                continue
            try:
                await self._handle(message)
            except Exception as error:  # one bad message must not stop the channel
                self._log.error("message_failed", channel="control", error=repr(error), exc_info=True)

    async def _handle(self, message: ToFrontend) -> None:
        if isinstance(message, WorkerSet):
            if message.version > self._link.worker_set.version:
                self._link.apply_worker_set(message)
                self.links_changed(resend=True)
        elif isinstance(message, CommandResult):
            future = self._pending.get(message.command_id)
            if future is not None and not future.done():
                future.set_result(message)
        elif isinstance(message, TenantsUpdate):
            if message.version > self._tenants_version:  # an older one would bring back what a reload revoked
                self.on_tenants(message.tenants)
                self._tenants_version = message.version
            # The daemon sends it again until it hears this: a lost answer is answered again.
            with contextlib.suppress(zmq.Again):
                await self._outbox.send(self._codec.encode(TenantsApplied(self._tenants_version)), zmq.NOBLOCK)
