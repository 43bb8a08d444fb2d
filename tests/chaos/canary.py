"""Canaries: one short real generation over gRPC and one over HTTP, to tell whether the daemon still serves
everyone else; and the wait for health plus a passing canary after a fault."""

from __future__ import annotations

import itertools
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from chaos.clients import COMPLETE, ClientRecord, grpc_generate, http_generate
from chaos.daemon_setup import GRPC_TENANT, HTTP_TENANT, Tenants
from chaos.grpc_fuzz import CHANNEL_OPTIONS
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

CANARY_TOKENS = 4


class Canary:
    def __init__(self, grpc_address: str, http_url: str, tenants: Tenants, timeout: float):
        self.channel = grpc.insecure_channel(grpc_address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.http = httpx.Client()
        self.http_url = http_url
        self.tenants = tenants
        self.timeout = timeout
        self.records: list[ClientRecord] = []  # every canary request, for the ledger audit
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def check(self) -> tuple[bool, str]:
        """Both canaries; ok iff each generated exactly its tokens and finished."""
        results = [self._grpc_once(), self._http_once()]
        with self._lock:
            self.records.extend(results)
        failed = [r for r in results if not (r.end == COMPLETE and r.completion_tokens == CANARY_TOKENS)]
        return not failed, "; ".join(f"{r.surface}: {r.end} {r.detail}".strip() for r in failed)

    def _grpc_once(self) -> ClientRecord:
        request = pb.GenerateRequest(
            prompt="canary",
            request_id=f"chaos-canary-{next(self._ids)}",
            sampling=pb.SamplingParams(max_tokens=CANARY_TOKENS, ignore_eos=True),
        )
        return grpc_generate(self.stub, request, self.tenants.metadata(GRPC_TENANT), GRPC_TENANT, self.timeout)

    def _http_once(self) -> ClientRecord:
        body = {"prompt": "canary", "max_tokens": CANARY_TOKENS, "ignore_eos": True}
        url = f"{self.http_url}/v1/completions"
        return http_generate(self.http, url, body, self.tenants.bearer(HTTP_TENANT), HTTP_TENANT, self.timeout)

    def healthy(self) -> bool:
        """gRPC health SERVING and the gateway's /health 200."""
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
            return self.http.get(f"{self.http_url}/health", timeout=2.0).status_code == 200
        except (grpc.RpcError, httpx.HTTPError):
            return False

    def wait_recovered(self, since: float, bound: float) -> float | None:
        """Seconds from `since` (time.monotonic()) until healthy with a passing canary; None if not within bound."""
        deadline = since + bound
        while time.monotonic() < deadline:
            if self.healthy() and self.check()[0]:
                return time.monotonic() - since
            time.sleep(0.2)
        return None
