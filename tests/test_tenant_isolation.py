"""What one tenant can learn about another: nothing through the prefix cache, request ids or /metrics."""

from __future__ import annotations

import hashlib
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from daemon_harness import Daemon

from tokend.v1 import tokend_pb2 as pb

KEYS = {name: f"sk-{name}-0123456789" for name in ("alpha", "beta", "gamma", "delta")}
METRICS_TOKEN = "metrics-token-0123456789"
# Several KV pages long, so that a repeat of it is served from the prefix cache.
SYSTEM_PROMPT = "You are a careful assistant of the accounts team. Answer in one short sentence. " * 3


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = tmp_path_factory.mktemp("isolation") / "tokend.toml"
    tables = [f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{_sha(key)}"\n' for name, key in KEYS.items()]
    # gamma and delta both name the group: they share cached prompts (a common system prompt, say).
    tables = [t + ('cache_group = "support"\n' if name in ("gamma", "delta") else "") for t, name in
              zip(tables, KEYS, strict=True)]  # fmt: skip
    config.write_text(f'metrics_token_sha256 = "{_sha(METRICS_TOKEN)}"\n\n' + "\n".join(tables))
    with Daemon("--config", str(config)) as running:
        yield running


def _as(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


def _cached_tokens(daemon: Daemon, tenant: str, prompt: str) -> int:
    request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=2, temperature=0))
    chunks = list(daemon.generation.Generate(request, metadata=_as(tenant), timeout=60))
    return chunks[-1].usage.cached_tokens


def test_a_second_tenant_sending_the_first_tenants_prompt_sees_no_cached_tokens(daemon):
    prompt = SYSTEM_PROMPT + "What is the balance of account 1?"
    assert _cached_tokens(daemon, "alpha", prompt) == 0
    assert _cached_tokens(daemon, "alpha", prompt) > 0  # the cache works: alpha's own repeat is served from it
    assert _cached_tokens(daemon, "beta", prompt) == 0  # beta learns nothing of what alpha sent
    assert _cached_tokens(daemon, "beta", prompt) > 0


def test_tenants_of_one_cache_group_share_cached_prompts(daemon):
    prompt = "Support: " + SYSTEM_PROMPT  # a prefix no test sent before
    assert _cached_tokens(daemon, "gamma", prompt) == 0
    assert _cached_tokens(daemon, "delta", prompt) > 0
    assert _cached_tokens(daemon, "alpha", prompt) == 0  # outside the group


def test_request_ids_belong_to_their_tenant(daemon):
    """The same id in flight for two tenants is two requests; neither can abort, nor learn of, the other's."""
    long = pb.SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
    started = threading.Event()
    outcome: dict[str, object] = {}

    def alpha_runs() -> None:
        request = pb.GenerateRequest(prompt="alpha's", request_id="shared-id", sampling=long)
        chunks = []
        for chunk in daemon.generation.Generate(request, metadata=_as("alpha"), timeout=120):
            chunks.append(chunk)
            started.set()
        outcome["alpha"] = chunks

    thread = threading.Thread(target=alpha_runs)
    thread.start()
    try:
        assert started.wait(60)
        # alpha itself may not reuse the id while it is in flight...
        again = pb.GenerateRequest(prompt="x", request_id="shared-id", sampling=pb.SamplingParams(max_tokens=1))
        with pytest.raises(grpc.RpcError) as refused:
            list(daemon.generation.Generate(again, metadata=_as("alpha"), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in refused.value.details()
        # ...but beta's request of the same id is its own, and beta's abort of that id touches only beta's.
        beta = pb.GenerateRequest(
            prompt="beta's", request_id="shared-id", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
        )
        assert list(daemon.generation.Generate(beta, metadata=_as("beta"), timeout=60))[-1].finish_reason == "length"
        aborted = daemon.generation.Abort(pb.AbortRequest(request_id="shared-id"), metadata=_as("beta"), timeout=10)
        assert not aborted.aborted
    finally:
        thread.join(timeout=120)
    assert outcome["alpha"][-1].finish_reason == "length"
    assert outcome["alpha"][-1].usage.completion_tokens == 400


def _scrape(daemon: Daemon, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{daemon.metrics_port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


def test_metrics_need_the_token_and_name_no_tenant_unless_asked(daemon):
    _cached_tokens(daemon, "alpha", "metered for the operator")
    assert _scrape(daemon, None)[0] == 401
    assert _scrape(daemon, "wrong-token")[0] == 401
    status, text = _scrape(daemon, METRICS_TOKEN)
    assert status == 200 and "tokend:generation_tokens_total" in text
    # Tenant-labelled series only with tenant_metrics: the names and usage of tenants are for the ledger.
    assert "tokend:tenant_" not in text and "alpha" not in text
