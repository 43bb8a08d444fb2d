"""Tenants against a real `tokend serve --config`: keys, permissions, and keys never written to a log."""

from __future__ import annotations

import hashlib

import grpc
import httpx
import openai
import pytest
from daemon_harness import Daemon
from grpc_health.v1 import health_pb2

from gpu_runtime.default_model import TINY_RANDOM_MODEL_NAME
from tokend.v1 import tokend_pb2 as pb

WRONG_KEY = "sk-refused-5551234567"  # no tenant's: refused, and never logged either
KEYS = {"alpha": "sk-alpha-0123456789", "beta": "sk-beta-0123456789", "gamma": "sk-gamma-0123456789"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("tenants") / "tokend.toml"
    config.write_text(
        f"""
[[tenants]]
name = "alpha"
api_key_sha256 = "{_sha(KEYS["alpha"])}"
admin = true

[[tenants]]
name = "beta"
api_key_sha256 = "{_sha(KEYS["beta"])}"
priority = "batch"
max_priority = "batch"

[[tenants]]
name = "gamma"
api_key_sha256 = "{_sha(KEYS["gamma"])}"
models = ["some-other-model"]
"""
    )
    with Daemon("--config", str(config)) as running:
        yield running


def _as(tenant: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),) if tenant else ()


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


HELLO = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True))


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", f"Bearer {WRONG_KEY}"),), (("authorization", "sk-alpha"),)]
)
def test_every_rpc_but_health_needs_a_valid_key(daemon, metadata):
    rpcs = [
        lambda: list(daemon.generation.Generate(HELLO, metadata=metadata, timeout=10)),
        lambda: daemon.generation.Abort(pb.AbortRequest(request_id="x"), metadata=metadata, timeout=10),
        lambda: daemon.generation.ListModels(pb.ListModelsRequest(), metadata=metadata, timeout=10),
        lambda: daemon.admin.GetLoad(pb.GetLoadRequest(), metadata=metadata, timeout=10),
        lambda: daemon.admin.Drain(pb.DrainRequest(), metadata=metadata, timeout=10),
        lambda: daemon.admin.GetUsage(pb.GetUsageRequest(), metadata=metadata, timeout=10),
    ]
    assert [_code(rpc) for rpc in rpcs] == [grpc.StatusCode.UNAUTHENTICATED] * len(rpcs)
    assert daemon.health_status() == health_pb2.HealthCheckResponse.SERVING


def test_a_valid_key_is_served_with_its_tenants_rights(daemon):
    chunks = list(daemon.generation.Generate(HELLO, metadata=_as("beta"), timeout=30))
    assert chunks[-1].finish_reason == "length"
    interactive = pb.GenerateRequest(prompt="Hi", priority=pb.PRIORITY_INTERACTIVE)
    assert _code(lambda: list(daemon.generation.Generate(interactive, metadata=_as("beta"), timeout=10))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert _code(lambda: list(daemon.generation.Generate(HELLO, metadata=_as("gamma"), timeout=10))) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert daemon.generation.ListModels(pb.ListModelsRequest(), metadata=_as("gamma"), timeout=10).models == []
    assert _code(lambda: daemon.admin.GetLoad(pb.GetLoadRequest(), metadata=_as("beta"), timeout=10)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert daemon.admin.GetLoad(pb.GetLoadRequest(), metadata=_as("alpha"), timeout=10).schedulers


def test_a_tenant_cannot_abort_another_tenants_request(daemon):
    long = pb.GenerateRequest(
        prompt="mine", request_id="alpha-1", sampling=pb.SamplingParams(max_tokens=1500, ignore_eos=True)
    )
    call = daemon.generation.Generate(long, metadata=_as("alpha"), timeout=60)
    next(call)
    assert not daemon.generation.Abort(pb.AbortRequest(request_id="alpha-1"), metadata=_as("beta"), timeout=10).aborted
    assert daemon.generation.Abort(pb.AbortRequest(request_id="alpha-1"), metadata=_as("alpha"), timeout=10).aborted
    assert list(call)[-1].finish_reason == "abort"


def test_the_gateway_passes_the_key_and_maps_refusals(daemon):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key=KEYS["alpha"], max_retries=0) as client:
        reply = client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt="Hi", max_tokens=2)
        assert reply.usage.completion_tokens >= 1
    refusals = [(WRONG_KEY, openai.AuthenticationError), (KEYS["gamma"], openai.PermissionDeniedError)]
    for key, refusal in refusals:
        client = openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key=key, max_retries=0)
        with client, pytest.raises(refusal):
            client.completions.create(model=TINY_RANDOM_MODEL_NAME, prompt="Hi", max_tokens=2)
    assert httpx.get(f"{daemon.http_url}/v1/models").status_code == 401
    assert httpx.get(f"{daemon.http_url}/health").status_code == 200


def test_no_key_appears_in_any_log_line(daemon):
    log = daemon.log_path.read_text()
    assert '"tenants": ["alpha", "beta", "gamma"]' in log
    for key in [*KEYS.values(), WRONG_KEY]:  # neither a tenant's key nor a refused one
        assert key not in log and key[3:] not in log
    assert "AUTHENTICATION_IS_OFF" not in log
