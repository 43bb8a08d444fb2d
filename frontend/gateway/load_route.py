"""GET /v1/load: the frontend's load reports (Admin.GetLoad) as JSON, for the playground's live panel and for
anyone who would rather read JSON than speak gRPC.

The caller's own Authorization travels on, so the frontend decides, exactly as for the gRPC call: with tenants
configured only an admin tenant's key is answered (401 without a known key, 403 for a non-admin one); with
tenants off anyone who reaches the gateway may read it, as they may call Admin.GetLoad on the gRPC port.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from starlette.requests import Request
from starlette.responses import Response

from frontend.gateway.errors import from_grpc
from frontend.gateway.json_wire import LineSafeJSONResponse
from frontend.gateway.routes import GatewayRoutes, _auth_metadata
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc

_TIMEOUT_S = 5  # the frontend answers from memory: a slower answer means it is in trouble, and the panel retries
_NO_STORE = {"Cache-Control": "no-store"}  # a load figure is stale in a second; no cache may keep one


def load_endpoint(routes: GatewayRoutes) -> Callable[[Request], Awaitable[Response]]:
    """The handler of GET /v1/load, on the gateway's gRPC channel (which exists only once the app has started)."""

    async def load(request: Request) -> Response:
        stub = pb_grpc.AdminStub(routes.channel)
        try:
            reply = await stub.GetLoad(pb.GetLoadRequest(), metadata=_auth_metadata(request), timeout=_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise from_grpc(error.code(), error.details(), chat=False) from None
        return LineSafeJSONResponse(load_body(reply), headers=_NO_STORE)

    return load


def load_body(reply: pb.GetLoadResponse) -> dict:
    """GetLoadResponse as JSON, field for field (the proto documents each)."""
    return {
        "object": "load",
        "draining": reply.draining,
        "in_flight": reply.in_flight,
        "schedulers": [
            {
                "model": s.model,
                "group": s.group,
                "ready": s.ready,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "projected_ttft_seconds": s.projected_ttft_seconds,
                "report_age_seconds": s.report_age_seconds,
                "pid": s.pid,
                "worker_id": s.worker_id,
                "state": s.state,
                "generation": s.generation,
                "role": s.role,
                "epoch": s.epoch,
            }
            for s in reply.schedulers
        ],
        "autoscale": [
            {
                "model": a.model,
                "desired_replicas": a.desired_replicas,
                "direction": a.direction,
                "reason": a.reason,
                "effective_ttft_seconds": a.effective_ttft_seconds,
                "queue_depth": a.queue_depth,
            }
            for a in reply.autoscale
        ],
    }
