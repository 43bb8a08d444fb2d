"""The KV transport interface: a factory makes each common.lanes.KVTransport's two sides, every pull request is
answered by exactly one transport's server side (a lease's release by the server itself, whatever the transport),
and a server without a transport names what it does not serve."""

from __future__ import annotations

import queue
from types import SimpleNamespace

import pytest
import structlog
import torch
import zmq

from common.lanes import KVTransport
from gpu_runtime.kv_cache.manager import KVCacheManager
from gpu_runtime.kv_transfer.leases import KVLeases
from gpu_runtime.kv_transfer.nixl_protocol import NixlPull, NixlServe
from gpu_runtime.kv_transfer.puller import KVPuller, PullJob
from gpu_runtime.kv_transfer.server import KVServer
from gpu_runtime.kv_transfer.transport import make_pull_transport, make_serve_transports
from gpu_runtime.kv_transfer.wire import ReleaseLease, ToKVServer, TransportRequest
from gpu_runtime.kv_transfer.zmq_frames import FramesPull, FramesServe

pytestmark = pytest.mark.fast


def _pool():
    return SimpleNamespace(layers=[(torch.zeros(4, 2, 1, 2), torch.zeros(4, 2, 1, 2))])


def test_the_factory_makes_each_transports_pull_side():
    assert isinstance(make_pull_transport(KVTransport.ZMQ), FramesPull)
    assert isinstance(make_pull_transport(KVTransport.NIXL), NixlPull)  # nixl itself is loaded at its first pull


def test_every_pull_request_is_served_by_exactly_one_transport():
    transports = make_serve_transports(_pool(), KVLeases(KVCacheManager(4, 2)), structlog.get_logger())
    assert [type(t) for t in transports] == [FramesServe, NixlServe]
    served = [message for transport in transports for message in transport.messages]
    assert sorted(m.__name__ for m in served) == sorted(m.__name__ for m in TransportRequest.__args__)
    assert set(ToKVServer.__args__) == {*TransportRequest.__args__, ReleaseLease}


def test_the_puller_takes_the_enum_or_its_value_and_refuses_other_names():
    context = zmq.Context()
    try:
        assert KVPuller(context, queue.Queue(), 1.0, 1 << 20, "nixl").transport is KVTransport.NIXL
        assert KVPuller(context, queue.Queue(), 1.0, 1 << 20).transport is KVTransport.ZMQ
        with pytest.raises(ValueError, match="'tcp' is not a valid KVTransport"):
            KVPuller(context, queue.Queue(), 1.0, 1 << 20, "tcp")
    finally:
        context.destroy(linger=0)


def test_a_server_without_a_transport_says_so_to_its_reader(tmp_path):
    """A NIXL reader of a prefill worker that serves ZeroMQ frames only: its pull fails, naming why."""
    context, inbox = zmq.Context(), queue.Queue()
    address = f"ipc://{tmp_path}/kv.ipc"
    leases = KVLeases(KVCacheManager(4, 2))
    server = KVServer(context, address, _pool(), leases, queue.Queue(), structlog.get_logger(), (KVTransport.ZMQ,))
    server.start()
    puller = KVPuller(context, inbox, timeout_s=10, max_bytes=1 << 20, transport=KVTransport.NIXL)
    puller.start()
    try:
        puller.pull(PullJob("r", address, "lease", [0]))
        result = inbox.get(timeout=20)
        assert result.keys is None
        assert "a LockPages of lease 'lease' is not served here (zmq is)" in result.error
    finally:
        puller.stop()
        puller.join(timeout=10)
        server.stop()
        server.join(timeout=5)
        context.destroy(linger=0)
