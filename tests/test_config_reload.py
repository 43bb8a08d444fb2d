"""SIGHUP's reload, its parts: what a reread config changes and says, what it refuses, and the frontend's switch to
the new tenants (keys, quotas) with nothing refilled. End to end against a daemon: test_sighup_reload.py."""

from __future__ import annotations

import asyncio
import hashlib
import re

import grpc
import pytest
import structlog
from structlog.testing import capture_logs

from daemon.cli import build_parser
from daemon.config import ServeConfig, load_serve_config
from daemon.config_reload import reload_tenants
from frontend.admission import AdmissionController, Shed
from frontend.errors import RequestError
from frontend.metrics import FrontendMetrics
from frontend.scheduler_link import SchedulerLink
from frontend.spec import AdmissionSpec, FrontendSpec, TenantSpec
from frontend.tenant_reload import apply_tenants
from frontend.tenants import Authenticator
from gpu_runtime.ipc.enums import Priority


def _key(name: str) -> str:
    return f"sk-{name}-0123456789"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _tenant(name: str, key: str | None = None, **fields) -> str:
    lines = [f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{_sha(key or _key(name))}"']
    lines += [f"{field} = {value!r}".replace("'", '"') for field, value in fields.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "tokend.toml"
    path.write_text("max_num_seqs = 4\n" + _tenant("alice") + _tenant("carol") + _tenant("dan"))
    return path


def _loader(*argv: str):
    """What the supervisor is given: load_serve_config again on the daemon's own arguments."""
    args = build_parser().parse_args(["serve", *argv])
    return lambda: load_serve_config(args)


def _started(config_file) -> tuple[ServeConfig, object]:
    reload_config = _loader("--config", str(config_file), "--grpc-port", "6000")
    return reload_config(), reload_config


def test_a_reload_takes_the_new_tenants_and_says_what_changed_without_a_key(config_file):
    current, reload_config = _started(config_file)
    config_file.write_text(
        "max_num_seqs = 4\n"
        + _tenant("carol", key="sk-carol-rotated-42")
        + _tenant("dan", tokens_per_minute=600, priority="batch")
        + _tenant("bob")
    )
    reload = reload_tenants(current, reload_config)
    assert reload.changes == [
        "tenant 'alice' removed",
        "tenant 'carol': api key changed",
        'tenant \'dan\': priority "interactive" -> "batch"',
        "tenant 'dan': tokens_per_minute 0 -> 600",
        "tenant 'bob' added",
    ]
    assert [t.name for t in reload.config.tenants] == ["carol", "dan", "bob"]
    assert reload.config.tenants[0].api_key_sha256 == _sha("sk-carol-rotated-42")
    assert reload.needs_restart == []
    said = " ".join(reload.changes)
    assert _sha(_key("carol")) not in said and _sha("sk-carol-rotated-42") not in said


def test_the_same_file_again_changes_nothing(config_file):
    current, reload_config = _started(config_file)
    reload = reload_tenants(current, reload_config)
    assert (reload.changes, reload.needs_restart, reload.config) == ([], [], current)


def test_other_keys_wait_for_a_restart_and_are_named(config_file):
    current, reload_config = _started(config_file)
    # grpc_port is a flag too, and flags still win over the file: unchanged, so not named.
    config_file.write_text(
        "max_num_seqs = 8\nmax_queued_requests = 7\ngrpc_port = 7000\ndrain_timeout = 5\n"
        + _tenant("alice")
        + _tenant("carol")
        + _tenant("dan")
        + _tenant("bob")
    )
    reload = reload_tenants(current, reload_config)
    assert reload.needs_restart == ["drain_timeout", "max_num_seqs", "max_queued_requests"]
    assert reload.changes == ["tenant 'bob' added"]
    config = reload.config
    assert (config.drain_timeout, config.grpc_port) == (current.drain_timeout, 6000)
    assert (config.engine, config.admission) == (current.engine, current.admission)


def test_a_reload_may_turn_authentication_on(tmp_path):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text("max_num_seqs = 4\n")
    current, reload_config = _started(config_file)
    config_file.write_text("max_num_seqs = 4\n" + _tenant("alice"))
    reload = reload_tenants(current, reload_config)
    assert (reload.changes, [t.name for t in reload.config.tenants]) == (["tenant 'alice' added"], ["alice"])


# A file that adds a good tenant (bob) and gets something else wrong: nothing of it applies, bob neither.
# (Top-level keys come before the tables: after one, TOML puts them in it.)
_GOOD = _tenant("alice") + _tenant("bob")


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (_GOOD + "[[tenants]\n", "config"),  # not TOML
        (_GOOD + '[[tenants]]\nname = "eve"\napi_key_sha256 = "not-a-hash"\n', "tenants[2].api_key_sha256"),
        (_GOOD + _tenant("alice", key="sk-other-1234567"), "tenants[2].name"),
        (_GOOD + _tenant("eve", priority="urgent"), "tenants[2].priority"),
        (_GOOD + _tenant("eve", tokens_per_minute="lots"), "tenants[2]"),
        ("max_num_seqs = 0\n" + _GOOD, "max_num_seqs"),
        ("no_such_key = 1\n" + _GOOD, "no_such_key"),
        ('tenants_file = "/nonexistent/tenants.toml"\n' + _GOOD, "tenants_file"),
        # Every tenant gone would turn authentication off: a restart's decision, not a reload's.
        ("max_num_seqs = 4\n", "tenants"),
    ],
)
def test_a_bad_file_is_refused_whole_with_the_key_named(config_file, text, key):
    current, reload_config = _started(config_file)
    config_file.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}:"):
        reload_tenants(current, reload_config)


def test_the_tenants_file_is_read_again(tmp_path):
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(_tenant("alice"))
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(f'tenants_file = "{tenants_file}"\n' + _tenant("carol"))
    current, reload_config = _started(config_file)
    tenants_file.write_text(_tenant("alice", max_concurrent=2) + _tenant("bob"))
    reload = reload_tenants(current, reload_config)
    assert reload.changes == ["tenant 'alice': max_concurrent 0 -> 2", "tenant 'bob' added"]
    assert [t.name for t in reload.config.tenants] == ["carol", "alice", "bob"]


# -- the frontend's side --------------------------------------------------------------------------------------------


def _spec(name: str, tokens_per_minute: int = 0) -> TenantSpec:
    return TenantSpec(name, _sha(_key(name)), tokens_per_minute=tokens_per_minute)


def _frontend_spec(tmp_path) -> FrontendSpec:
    return FrontendSpec(
        grpc_port=1,
        metrics_port=None,
        output_address=f"ipc://{tmp_path}/outputs.ipc",
        schedulers=[],
        default_model="m",
        secret_path=str(tmp_path / "secret"),
    )


async def _admit_code(admission: AdmissionController, tenant: TenantSpec) -> str:
    """Shed's reason when the tenant's limits refuse it; else the error of the model this test has no scheduler
    for, which a request meets only once past its tenant's limits."""
    try:
        await admission.admit("m", tenant, Priority.INTERACTIVE, cost=1)
    except Shed as shed:
        return shed.reason
    except RequestError as error:
        return error.code.name
    raise AssertionError("admitted with no scheduler")


def test_the_frontend_takes_new_keys_and_keeps_what_was_spent_of_each_quota(tmp_path):
    async def scenario() -> dict[str, object]:
        link = SchedulerLink(_frontend_spec(tmp_path), structlog.get_logger(), on_change=lambda: None)
        old = [_spec("alice"), _spec("carol"), _spec("dan", tokens_per_minute=60)]
        authenticator = Authenticator(old)
        admission = AdmissionController(link, AdmissionSpec(), FrontendMetrics(), old)
        seen: dict[str, object] = {}
        try:
            admission.account("m", "dan", Priority.INTERACTIVE, estimated=0, prompt=40, completion=50)  # 30 over
            seen["dan before"] = await _admit_code(admission, old[2])

            same_quota = [_spec("alice"), _spec("dan", tokens_per_minute=60), _spec("bob")]
            with capture_logs() as logs:
                apply_tenants(same_quota, authenticator, admission, structlog.get_logger())
            seen["logged"] = [(entry["event"], entry["tenants"]) for entry in logs]
            seen["bob"] = authenticator.authenticate([("authorization", f"Bearer {_key('bob')}")]).name
            with pytest.raises(RequestError) as refused:
                authenticator.authenticate([("authorization", f"Bearer {_key('carol')}")])
            seen["carol"] = refused.value.code
            seen["dan, quota as it was"] = await _admit_code(admission, same_quota[1])

            # 90 of 120 spent: room left, not a fresh minute's worth.
            raised = [_spec("alice"), _spec("dan", tokens_per_minute=120), _spec("bob")]
            apply_tenants(raised, authenticator, admission, structlog.get_logger())
            seen["dan, quota raised"] = await _admit_code(admission, raised[1])
            admission.account("m", "dan", Priority.INTERACTIVE, estimated=0, prompt=20, completion=20)
            seen["dan, raised quota spent"] = await _admit_code(admission, raised[1])
        finally:
            admission.close()
            link.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen == {
        "dan before": "tokens_per_minute",
        "logged": [("tenants_applied", ["alice", "dan", "bob"])],
        "bob": "bob",
        "carol": grpc.StatusCode.UNAUTHENTICATED,
        "dan, quota as it was": "tokens_per_minute",
        "dan, quota raised": "UNAVAILABLE",
        "dan, raised quota spent": "tokens_per_minute",
    }
