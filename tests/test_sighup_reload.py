"""SIGHUP against a real `tokend serve --config`: a new tenant's key works and a removed one's is refused, with no
stream interrupted and no process restarted; a bad file is refused whole and the running tenants stay."""

from __future__ import annotations

import hashlib
import signal

import grpc
import pytest
from daemon_harness import Daemon
from harness.systemd_socket import NotifySocket

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


def _reload(daemon: Daemon, systemd: NotifySocket) -> str:
    """Sends SIGHUP as `systemctl reload` does and waits, as systemd does, for RELOADING=1 and then READY=1: the
    reload is over, taken or refused. Returns the STATUS= systemd shows for it."""
    daemon.process.send_signal(signal.SIGHUP)
    reloading = systemd.wait_for("RELOADING=1", after=len(systemd.messages), timeout=30)
    done = systemd.messages[systemd.wait_for("READY=1", after=reloading + 1, timeout=30)]
    return next(line.removeprefix("STATUS=") for line in done.splitlines() if line.startswith("STATUS="))


def test_sighup_adds_and_removes_tenants_with_no_stream_interrupted(config_file):
    with NotifySocket() as systemd, Daemon("--config", str(config_file), env=systemd.env) as daemon:
        systemd.wait_for("READY=1")
        processes = sorted(daemon.child_pids("tokend: "))
        streams = {name: _open_stream(daemon, name) for name in ("alice", "carol")}
        assert _refusal(daemon, "bob") == grpc.StatusCode.UNAUTHENTICATED

        config_file.write_text("max_queued_requests = 7\n" + _tenants("alice", "bob"))
        # READY=1 comes once the frontend has taken the new tenants: bob's key works from then on.
        assert _reload(daemon, systemd) == "serving; configuration reloaded"
        assert _refusal(daemon, "bob") is None
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
    with NotifySocket() as systemd, Daemon("--config", str(config_file), env=systemd.env) as daemon:
        systemd.wait_for("READY=1")
        # Bob is fine, the third tenant's hash is not: bob is not taken either.
        config_file.write_text(_tenants("alice", "bob") + '[[tenants]]\nname = "eve"\napi_key_sha256 = "abc"\n')
        refused = "serving; the configuration reload was refused: "
        assert _reload(daemon, systemd).startswith(refused + "tenants[2].api_key_sha256:")

        config_file.write_text("")  # no tenants at all would turn authentication off
        assert _reload(daemon, systemd).startswith(refused + "tenants:")
        # The operator reads the same in the log (systemd shows the STATUS= line).
        errors = [record["error"] for record in daemon.log_entries("config_reload_refused")]
        assert [error.split(":")[0] for error in errors] == ["tenants[2].api_key_sha256", "tenants"]

        assert daemon.process.poll() is None
        assert {name: _refusal(daemon, name) for name in KEYS} == {
            "alice": None,
            "bob": grpc.StatusCode.UNAUTHENTICATED,
            "carol": None,
        }
        assert daemon.log_entries("config_reloaded") == []
