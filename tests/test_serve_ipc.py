"""The scheduler's sockets take only typed messages (never pickle), nothing listens beyond loopback, and only the
scheduler processes load torch."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import msgspec
import pytest
import zmq
from daemon_harness import Daemon

from gpu_runtime.ipc.enums import FinishReason, Priority
from gpu_runtime.ipc.messages import (
    AbortRequests,
    AddRequest,
    RequestDelta,
    StepOutputs,
    frontend_codec,
    scheduler_codec,
)
from gpu_runtime.ipc.sampling_params import SamplingParams


class _Exploit:
    """Unpickling this runs a command: what an attacker sends to a pickle-speaking socket."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def daemon():
    with Daemon() as running:
        yield running


def test_bad_bytes_and_pickles_on_ipc_sockets_are_dropped_and_serving_goes_on(daemon, tmp_path):
    marker = tmp_path / "pwned"
    payloads = [b"", b"\x00garbage\xff", pickle.dumps(_Exploit(marker)), pickle.dumps({"type": "add"})]
    payloads.append(msgspec.msgpack.encode({"type": "add", "request_id": 7}))  # right shape, wrong field type
    runtime = daemon.runtime_dir()
    sockets = sorted(runtime.glob("*.ipc"))
    assert {p.name for p in sockets} >= {"frontend.ipc", "scheduler-0-0.ipc"}
    context = zmq.Context()
    try:
        for path in sockets:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(f"ipc://{path}")
            for payload in payloads:
                push.send(payload)
            push.close()
    finally:
        context.term()
    daemon.wait_for(lambda: daemon.log().count("dropped_bad_message") >= 2 * len(payloads), timeout=5)
    assert not marker.exists(), "a pickle was unpickled"
    assert daemon.generate("still serving", max_tokens=4, ignore_eos=True)[-1].finish_reason == "length"


def test_the_runtime_directory_is_private_and_only_loopback_ports_listen(daemon):
    runtime = daemon.runtime_dir()
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    listening = _listening_tcp(daemon.session_pids())
    assert listening, "the gRPC, metrics and HTTP ports listen"
    assert {address for address, _ in listening} == {"127.0.0.1"}
    assert {port for _, port in listening} == {daemon.grpc_port, daemon.metrics_port, daemon.http_port}


def test_messages_round_trip_and_anything_else_is_refused():
    codec = scheduler_codec()
    params = SamplingParams(max_tokens=4, seed=9, stop_token_ids=[5])
    message = AddRequest("r1", [1, 2, 3], params, priority=Priority.BATCH)
    decoded = codec.decode(codec.encode(message))
    assert decoded == message and decoded.priority is Priority.BATCH and decoded.sampling.stop_token_ids == (5,)
    assert codec.decode(codec.encode(AbortRequests(["a", "b"]))) == AbortRequests(["a", "b"])
    for bad in [pickle.dumps(message), codec.encode(message)[:-1], frontend_codec().encode(StepOutputs("w", "i", []))]:
        with pytest.raises(msgspec.DecodeError):
            codec.decode(bad)
    delta = RequestDelta("r1", [7], None, FinishReason.LENGTH, 3, 4, 0)
    received = frontend_codec().decode(frontend_codec().encode(StepOutputs("w", "i", [delta]))).deltas[0]
    assert received == delta and received.finish_reason is FinishReason.LENGTH and received.finished


@pytest.mark.parametrize(
    ("field", "value"), [("sampling", {"temperature": -1}), ("sampling", {"top_p": 0}), ("priority", 7)]
)
def test_sampling_params_and_priority_are_validated_as_they_are_decoded(field, value):
    """The scheduler decodes SamplingParams itself, not a copy: a forged message with a bad value never reaches it."""
    wire = {"type": "add", "request_id": "r1", "prompt_token_ids": [1], "sampling": {}, "priority": 0, field: value}
    with pytest.raises(msgspec.ValidationError):
        scheduler_codec().decode(msgspec.msgpack.encode(wire))


def test_only_scheduler_processes_map_libtorch(daemon):
    """The frontend and the gateway never load torch (DESIGN.md): each would hold ~1 GB for nothing."""
    schedulers = daemon.child_pids("tokend: scheduler")
    assert schedulers and all(_maps_libtorch(pid) for pid in schedulers), "the check sees torch where it is"
    for title in ("tokend: frontend", "tokend: gateway", "tokend: serve"):
        pids = daemon.child_pids(title)
        assert pids, f"no {title} process"
        assert not any(_maps_libtorch(pid) for pid in pids), f"{title} has libtorch mapped"


def _maps_libtorch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _listening_tcp(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of the pids holds."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except (FileNotFoundError, PermissionError):
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address_hex, port_hex = local.split(":")
                found.append((_address(address_hex), int(port_hex, 16)))
    return found


def _address(address_hex: str) -> str:
    if address_hex.startswith("0000000000000000FFFF0000"):  # IPv4-mapped IPv6 (::ffff:a.b.c.d)
        address_hex = address_hex[-8:]
    if len(address_hex) == 8:  # IPv4, in little-endian byte order
        return ".".join(str(int(address_hex[i : i + 2], 16)) for i in (6, 4, 2, 0))
    return address_hex  # any other IPv6 listener is a failure, shown raw
