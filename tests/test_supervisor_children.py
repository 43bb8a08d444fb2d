"""Supervisor's own children (the frontend and the gateway) in process over fake children: restarted after the same
back-off as the workers, the daemon's exit code when one cannot serve, and the private spec files they start with."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from worker_fakes import FakeChildren, FakeLog

from common.exit_codes import EXIT_CANNOT_SERVE, EXIT_CONFIG_ERROR
from daemon.admin_token import read_admin_token
from daemon.config import ServeConfig
from daemon.supervisor import Supervisor, runtime_parent_problem
from frontend.control_messages import ControlHello, TenantsApplied, TenantsUpdate
from frontend.gateway.spec import GatewaySpec
from frontend.spec import FrontendSpec, TenantSpec, spec_text

pytestmark = pytest.mark.fast


@pytest.fixture
def runtime_parent(monkeypatch):
    """$RUNTIME_DIRECTORY for the supervisor: a short path of its own, since an ipc:// socket's path must fit in
    107 bytes (sun_path), which pytest's tmp_path under a parallel run's worker does not."""
    parent = tempfile.mkdtemp(prefix="tokend-test-")
    monkeypatch.setenv("RUNTIME_DIRECTORY", parent)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture
def supervisor(tmp_path, runtime_parent):
    children = FakeChildren()
    config = ServeConfig(device="cpu", http_port=18080, state_dir=str(tmp_path / "state"))
    made = Supervisor(config, FakeLog(), make_child=children)
    for child in made.children:
        child.start(0.0)
    yield made
    made.control.close()
    shutil.rmtree(made.runtime_dir, ignore_errors=True)


def test_the_frontend_and_the_gateway_are_the_supervisors_children(supervisor):
    assert [child.name for child in supervisor.children] == ["frontend", "gateway"]


def test_a_crashed_frontend_restarts_after_its_back_off(supervisor):
    frontend = supervisor.frontend
    frontend.exit(1)
    assert supervisor.watch_children(1.0) is None
    assert frontend.process is None and frontend.restart_at == 1.5
    assert supervisor.watch_children(1.4) is None and frontend.starts == 1
    assert supervisor.watch_children(1.5) is None and frontend.starts == 2 and frontend.is_running
    frontend.exit(1)  # again at once: the back-off doubles
    supervisor.watch_children(1.6)
    assert frontend.restart_at == pytest.approx(2.6)
    assert supervisor.gateway.starts == 1  # the other child is left alone


def test_a_child_up_for_30_s_has_recovered_and_its_back_off_starts_over(supervisor):
    gateway = supervisor.gateway
    for now in (1.0, 3.0):
        gateway.exit(1)
        supervisor.watch_children(now)
        supervisor.watch_children(now + 1.5)  # restarted
    assert gateway.consecutive_failures == 2
    gateway.exit(1)  # 35.5 s after its last start
    supervisor.watch_children(40.0)
    assert gateway.consecutive_failures == 1 and gateway.restart_at == 40.5


def test_a_child_with_a_configuration_error_stops_the_daemon(supervisor):
    supervisor.gateway.exit(EXIT_CONFIG_ERROR)  # a taken port
    assert supervisor.watch_children(1.0) == EXIT_CONFIG_ERROR


def test_a_child_that_keeps_crashing_stops_the_daemon_after_eight_restarts(supervisor):
    frontend, now, code = supervisor.frontend, 0.0, None
    while code is None and now < 1000:
        if frontend.is_running:
            frontend.exit(1)
        now += 5.0  # past every back-off, never up the 30 s that would count as recovered
        code = supervisor.watch_children(now)
    assert code == EXIT_CANNOT_SERVE and frontend.starts == 9


def test_the_frontend_and_gateway_specs_travel_in_private_files_not_argv(tmp_path, runtime_parent):
    key_hash = hashlib.sha256(b"sk-someone").hexdigest()
    config = ServeConfig(device="cpu", http_port=18080, state_dir=str(tmp_path / "state"),
                         tenants=(TenantSpec("someone", key_hash),))  # fmt: skip
    made = Supervisor(config, FakeLog(), make_child=FakeChildren())
    try:
        for child, spec_type in ((made.frontend, FrontendSpec), (made.gateway, GatewaySpec)):
            argument = child.spec_json  # what `ps` shows of it
            assert key_hash not in argument and not argument.startswith("{")
            assert Path(argument).parent == made.runtime_dir and stat.S_IMODE(os.stat(argument).st_mode) == 0o600
            spec = spec_type.from_json(spec_text(argument))
        frontend = FrontendSpec.from_json(spec_text(made.frontend.spec_json))
        assert [t.api_key_sha256 for t in frontend.tenants] == [key_hash]
        token = read_admin_token(config.state_dir)
        assert frontend.admin_token_sha256 == hashlib.sha256(token.encode()).hexdigest()
        assert frontend.admin_token_path == str(Path(config.state_dir) / "admin-token") and token not in str(spec)
    finally:
        made.control.close()
        shutil.rmtree(made.runtime_dir, ignore_errors=True)


def test_reloaded_tenants_are_versioned_and_sent_until_the_frontend_applies_them(tmp_path, runtime_parent, monkeypatch):
    config = ServeConfig(device="cpu", http_port=0, state_dir=str(tmp_path / "state"))
    reloaded = msgspec.structs.replace(config, tenants=(TenantSpec("new", hashlib.sha256(b"k").hexdigest()),))
    made = Supervisor(config, FakeLog(), reload_config=lambda: reloaded, make_child=FakeChildren())
    sent, inbox = [], []
    monkeypatch.setattr(made.control, "send", sent.append)
    monkeypatch.setattr(made.control, "receive", lambda: [inbox.pop()] if inbox else [])
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    try:
        made._reload_tenants()
        updates = lambda: [m for m in sent if isinstance(m, TenantsUpdate)]  # noqa: E731
        assert updates() == [TenantsUpdate(1, list(reloaded.tenants))]
        made._serve_control_channel()
        assert len(updates()) == 1  # not again within the second
        clock[0] += 1.5
        made._serve_control_channel()
        assert len(updates()) == 2  # unacknowledged: sent again
        inbox.append(TenantsApplied(1))
        made._serve_control_channel()
        clock[0] += 5.0
        made._serve_control_channel()
        assert len(updates()) == 2
        inbox.append(ControlHello("restarted"))  # a new frontend starts on the configuration's own tenants
        made._serve_control_channel()
        assert updates()[-1] == TenantsUpdate(1, list(reloaded.tenants)) and len(updates()) == 3
    finally:
        made.control.close()
        shutil.rmtree(made.runtime_dir, ignore_errors=True)


def test_a_runtime_directory_too_long_for_ipc_socket_paths_is_refused_naming_it(monkeypatch):
    long_parent = "/tmp/" + "d" * 80
    monkeypatch.setenv("RUNTIME_DIRECTORY", long_parent)
    problem = runtime_parent_problem()
    assert problem is not None and "RUNTIME_DIRECTORY" in problem and long_parent in problem and "107" in problem
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/tokend")
    assert runtime_parent_problem() is None
