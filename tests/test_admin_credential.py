"""The local admin credential in process: the interceptor over a fake handler (Drain and Rollout need the boot's
token while there are no tenants; the token is an admin's key when there are), the 0600 token file, and the keys
the CLI sends (a file, stdin, the environment, the token file; a literal flag warns)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import stat
from types import SimpleNamespace

import grpc
import pytest

from daemon.admin_token import ADMIN_TOKEN_FILE, read_admin_token, write_admin_token
from daemon.api_key import api_key_of
from daemon.rollout_command import admin_key_of
from frontend.auth_interceptor import AuthInterceptor, calling_tenant
from frontend.spec import TenantSpec
from frontend.tenants import Authenticator

pytestmark = pytest.mark.fast

TOKEN = "local-admin-token"
TOKEN_PATH = "/var/lib/tokend/admin-token"
ADMIN_KEY, USER_KEY = "sk-admin", "sk-user"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


TENANTS = [TenantSpec("ops", _sha(ADMIN_KEY), admin=True), TenantSpec("app", _sha(USER_KEY))]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    async def abort(self, code, details):
        raise Aborted(code, details)


def _call(method: str, key: str | None = None, tenants: list[TenantSpec] = (), token_sha256: str = _sha(TOKEN)):
    """What the handler behind the interceptor answers: "handled" (with the tenant it saw), or the abort."""

    async def handler(request, context):
        return ("handled", calling_tenant().name if calling_tenant() else None)

    async def continuation(details):
        return grpc.unary_unary_rpc_method_handler(handler)

    interceptor = AuthInterceptor(Authenticator(list(tenants)), token_sha256, TOKEN_PATH)
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
    details = SimpleNamespace(method=method, invocation_metadata=metadata)

    async def run():
        wrapped = await interceptor.intercept_service(continuation, details)
        try:
            return await wrapped.unary_unary(None, FakeContext())
        except Aborted as aborted:
            return aborted

    return asyncio.run(run())


DRAIN, ROLLOUT = "/tokend.v1.Admin/Drain", "/tokend.v1.Admin/Rollout"
READS = ["/tokend.v1.Admin/GetLoad", "/tokend.v1.Admin/GetRollout", "/tokend.v1.Admin/GetUsage"]


@pytest.mark.parametrize("method", [DRAIN, ROLLOUT])
def test_with_no_tenants_the_mutating_admin_rpcs_need_the_local_token(method):
    refused = _call(method)
    assert refused.code == grpc.StatusCode.UNAUTHENTICATED
    assert TOKEN_PATH in refused.details and "admin = true" in refused.details  # how to enable it
    assert _call(method, "guess").code == grpc.StatusCode.PERMISSION_DENIED
    assert _call(method, TOKEN) == ("handled", None)


@pytest.mark.parametrize("method", [*READS, "/tokend.v1.Generation/Generate"])
def test_with_no_tenants_reads_and_inference_stay_open(method):
    assert _call(method) == ("handled", None)


def test_a_frontend_without_a_token_refuses_drain_to_everyone_while_there_are_no_tenants():
    assert _call(DRAIN, "", token_sha256="").code == grpc.StatusCode.PERMISSION_DENIED
    assert _call(DRAIN, token_sha256="").code == grpc.StatusCode.UNAUTHENTICATED


def test_with_tenants_the_local_token_is_an_admins_key_for_admin_only():
    assert _call(ROLLOUT, TOKEN, TENANTS) == ("handled", None)
    assert _call(ROLLOUT, ADMIN_KEY, TENANTS) == ("handled", "ops")
    assert _call(ROLLOUT, USER_KEY, TENANTS).code == grpc.StatusCode.PERMISSION_DENIED
    assert _call(ROLLOUT, None, TENANTS).code == grpc.StatusCode.UNAUTHENTICATED
    # Not a tenant: it cannot generate (nobody to meter) or pass as one.
    assert _call("/tokend.v1.Generation/Generate", TOKEN, TENANTS).code == grpc.StatusCode.UNAUTHENTICATED


def test_the_token_file_is_the_service_users_alone_and_new_at_each_boot(tmp_path):
    first = write_admin_token(tmp_path)
    token = read_admin_token(tmp_path)
    assert _sha(token) == first and len(token) >= 40
    assert stat.S_IMODE((tmp_path / ADMIN_TOKEN_FILE).stat().st_mode) == 0o600
    assert write_admin_token(tmp_path) != first and _sha(read_admin_token(tmp_path)) != first
    assert sorted(p.name for p in tmp_path.iterdir()) == [ADMIN_TOKEN_FILE]  # nothing staged is left behind
    assert read_admin_token(tmp_path / "nowhere") == ""


def _args(**flags) -> SimpleNamespace:
    return SimpleNamespace(**{"api_key": None, "api_key_file": None, "state_dir": None, **flags})


def test_a_key_comes_from_a_file_stdin_or_the_environment_without_a_warning(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    stderr = io.StringIO()
    assert api_key_of(_args(api_key_file=str(key_file)), {}, stderr=stderr) == "sk-from-file"
    assert api_key_of(_args(api_key="-"), {}, stdin=io.StringIO("sk-from-stdin\n"), stderr=stderr) == "sk-from-stdin"
    assert api_key_of(_args(), {"TOKEND_API_KEY": "sk-from-env"}, stderr=stderr) == "sk-from-env"
    assert api_key_of(_args(), {}, stderr=stderr) == ""
    assert stderr.getvalue() == ""


def test_a_literal_key_flag_still_works_but_warns_why_and_what_to_use():
    stderr = io.StringIO()
    assert api_key_of(_args(api_key="sk-literal"), {}, stderr=stderr) == "sk-literal"
    warning = stderr.getvalue()
    assert "argv" in warning and "TOKEND_API_KEY" in warning and "--api-key-file" in warning
    assert "sk-literal" not in warning


@pytest.mark.parametrize(
    "flags, error",
    [({"api_key_file": "/no/such/key"}, "api_key_file"), ({"api_key": "-", "api_key_file": "/k"}, "api_key")],
)
def test_a_bad_key_source_is_named(flags, error):
    with pytest.raises(ValueError, match=f"^{error}:"):
        api_key_of(_args(**flags), {}, stdin=io.StringIO(""))


def test_rollout_sends_the_local_token_from_its_state_dir_when_no_key_is_given(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKEND_API_KEY", raising=False)
    write_admin_token(tmp_path)
    assert admin_key_of(_args(state_dir=str(tmp_path))) == read_admin_token(tmp_path)
    monkeypatch.setenv("TOKEND_API_KEY", "sk-admin-tenant")
    assert admin_key_of(_args(state_dir=str(tmp_path))) == "sk-admin-tenant"  # a key given wins
