"""A draining worker that finishes its last streams and exits: its final deltas come on the outputs socket, which
the frontend may read after it has seen the worker's input connection drop. Those streams end as the worker ended
them, not lost (and moved to another worker) for want of a moment's patience; a draining worker that exits with a
stream still unfinished loses it, after that moment."""

from __future__ import annotations

import asyncio

import pytest
import zmq
from link_fixtures import ready_link

from common.lanes import WorkerState
from frontend import scheduler_link
from gpu_runtime.ipc.enums import FinishReason
from gpu_runtime.ipc.messages import RequestDelta

pytestmark = pytest.mark.fast


class _Socket:
    """The worker's input socket as the watcher uses it once the connection dropped: `unmonitored` is set when the
    watcher has seen the disconnect (it stops monitoring before anything else)."""

    def __init__(self) -> None:
        self.unmonitored = asyncio.Event()

    def close(self, linger=None) -> None:
        pass

    def disable_monitor(self) -> None:
        self.unmonitored.set()


def _final(request_id: str) -> RequestDelta:
    return RequestDelta(request_id, [7], None, FinishReason.LENGTH, 4, 3, 0)


@pytest.mark.parametrize("final_comes", [True, False], ids=["final-delta-after-the-disconnect", "no-final-delta"])
def test_a_drained_workers_last_deltas_are_read_after_its_disconnect(monkeypatch, final_comes):
    monkeypatch.setattr(scheduler_link, "_LAST_OUTPUTS_GRACE_S", 0.5)
    asyncio.run(_drained_exit(monkeypatch, final_comes))


async def _drained_exit(monkeypatch, final_comes: bool) -> None:
    disconnect = asyncio.Event()  # the link's connection monitor reports a disconnect once this is set

    async def next_event(monitor):
        await disconnect.wait()
        return {"event": zmq.EVENT_DISCONNECTED}

    monkeypatch.setattr(scheduler_link, "recv_monitor_message", next_event)
    link = ready_link(1)
    reconnected = []
    monkeypatch.setattr(link, "_connect", reconnected.append)  # a lost worker's link reconnects for its restart
    try:
        (state,) = link.schedulers
        state.worker_state = WorkerState.DRAINING
        stream = link.streams.open("req-1", state)
        socket = _Socket()
        watching = asyncio.create_task(link._watch(state, socket, _Socket()))
        disconnect.set()
        await socket.unmonitored.wait()  # the watcher saw the disconnect first, as it may in a real frontend
        assert not stream.lost and not watching.done()
        if final_comes:
            link.streams.deliver(state, [_final("req-1")])
        await asyncio.wait_for(watching, timeout=30)
        assert reconnected == [state]
        if final_comes:
            assert not stream.lost and stream.queue.get_nowait().finish_reason == FinishReason.LENGTH
        else:
            assert stream.lost
    finally:
        link.close()
