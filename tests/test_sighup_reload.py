"""SIGHUP against a real `tokend serve --config`: a new tenant's key works and a removed one's is refused, with no
stream interrupted and no process restarted; a bad file is refused whole and the running tenants stay."""

from __future__ import annotations

import hashlib
import signal

import grpc
import pytest
from daemon_harness import Daemon

from tokend.v1 import tokend_pb2 as pb

KEYS = {name: f"sk-{name}-0123456789" for name in ("alice", "bob", "carol")}
STREAM_TOKENS = 1500  # long enough to still be running while the reload happens


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenants(*names: str) -> str:
    return "".join(f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{_sha(KEYS[name])}"\n' for name in names)


def _as(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[name]}"),)


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tokend.toml"
    path.write_text(_tenants("alice", "carol"))
    return path


def _refusal(daemon: Daemon, name: str) -> grpc.StatusCode | None:
    """None when the tenant's key is accepted, else the code it is refused with."""
    try:
        daemon.generation.ListModels(pb.ListModelsRequest(), metadata=_as(name), timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return None


def _open_stream(daemon: Daemon, name: str):
    """A long stream of the tenant's, its first response already read: it is under way."""
    request = pb.GenerateRequest(
        prompt=f"{name} streams",
        sampling=pb.SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True, temperature=0),
    )
    stream = daemon.generation.Generate(request, metadata=_as(name), timeout=300)
    first = next(stream)
    return len(first.token_ids), stream


def _finish(opened) -> int:
    """Every token of a stream opened by _open_stream; raises if it ended in an error."""
    tokens, stream = opened
    return tokens + sum(len(response.token_ids) for response in stream)


def _refused_reload(daemon: Daemon, event: str) -> dict:
    """Sends SIGHUP and returns the daemon's log record of the reload (`event`) that answered it. Only for a reload
    that is refused: it changes nothing an API shows, so its log record, what an operator reads, is the check."""
    before = len(daemon.log_entries(event))
    daemon.process.send_signal(signal.SIGHUP)
    return daemon.wait_for(lambda: daemon.log_entries(event)[before:], timeout=30)[0]


def test_sighup_adds_and_removes_tenants_with_no_stream_interrupted(config_file):
    with Daemon("--config", str(config_file)) as daemon:
        processes = sorted(daemon.child_pids("tokend: "))
        streams = {name: _open_stream(daemon, name) for name in ("alice", "carol")}
        assert _refusal(daemon, "bob") == grpc.StatusCode.UNAUTHENTICATED

        config_file.write_text("max_queued_requests = 7\n" + _tenants("alice", "bob"))
        daemon.process.send_signal(signal.SIGHUP)
        # Reloaded once the frontend takes the new tenants; the daemon logged its report before it sent them.
        daemon.wait_for(lambda: _refusal(daemon, "bob") is None, timeout=30)
        (reloaded,) = daemon.log_entries("config_reloaded")

        assert _refusal(daemon, "carol") == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            list(daemon.generation.Generate(pb.GenerateRequest(prompt="Hi"), metadata=_as("carol"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _refusal(daemon, "alice") is None
        # Both streams run to their end, carol's too: a removed tenant's open streams finish.
        assert {name: _finish(opened) for name, opened in streams.items()} == {
            "alice": STREAM_TOKENS,
            "carol": STREAM_TOKENS,
        }
        assert reloaded["changes"] == ["tenant 'carol' removed", "tenant 'bob' added"]
        assert reloaded["needs_restart"] == ["max_queued_requests"]
        assert sorted(daemon.child_pids("tokend: ")) == processes  # nothing was restarted
        log = daemon.log_path.read_text()
        assert not any(key in log or _sha(key) in log for key in KEYS.values())


def test_a_bad_file_is_refused_whole_and_the_running_tenants_stay(config_file):
    with Daemon("--config", str(config_file)) as daemon:
        # Bob is fine, the third tenant's hash is not: bob is not taken either.
        config_file.write_text(_tenants("alice", "bob") + '[[tenants]]\nname = "eve"\napi_key_sha256 = "abc"\n')
        refused = _refused_reload(daemon, "config_reload_refused")
        assert refused["error"].startswith("tenants[2].api_key_sha256:")

        config_file.write_text("")  # no tenants at all would turn authentication off
        refused = _refused_reload(daemon, "config_reload_refused")
        assert refused["error"].startswith("tenants:")

        assert daemon.process.poll() is None
        assert {name: _refusal(daemon, name) for name in KEYS} == {
            "alice": None,
            "bob": grpc.StatusCode.UNAUTHENTICATED,
            "carol": None,
        }
        assert daemon.log_entries("config_reloaded") == []
