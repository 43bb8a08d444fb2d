"""Assembles the frontend: the gRPC server (Generation, Admin, health, reflection), the scheduler link, metrics."""

from __future__ import annotations

import asyncio
import signal

import grpc
import zmq
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.listening import mark_listening
from frontend.admin_service import AdminService
from frontend.admission import AdmissionController
from frontend.auth_interceptor import AuthInterceptor
from frontend.autoscaler import Autoscaler
from frontend.control_link import ControlLink
from frontend.error_interceptor import ErrorInterceptor
from frontend.generation_service import GenerationService
from frontend.grpc_reflection import enable_reflection
from frontend.kv_events_publisher import KVEventsPublisher
from frontend.lifecycle import Lifecycle
from frontend.metering import Meter
from frontend.metrics import FrontendMetrics
from frontend.models import ModelCatalog
from frontend.scheduler_link import SchedulerLink
from frontend.spec import FrontendSpec
from frontend.tenant_reload import apply_tenants
from frontend.tenants import Authenticator
from frontend.tokenize_pool import TokenizePool
from frontend.usage_ledger import UsageLedger
from gpu_runtime.ipc.peer_auth import read_secret
from tokend.v1 import tokend_pb2 as pb
from tokend.v1 import tokend_pb2_grpc as pb_grpc


class PortInUse(Exception):
    pass


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(spec: FrontendSpec, log) -> None:
    """Serves until SIGTERM/SIGINT, then drains: in-flight streams get up to drain_timeout_s to finish."""
    metrics = FrontendMetrics(spec.tenant_metrics)
    health_servicer = health.aio.HealthServicer()
    lifecycle: Lifecycle | None = None
    admission: AdmissionController | None = None
    control: ControlLink | None = None

    def on_change() -> None:
        lifecycle.schedule_health_refresh()
        admission.pump()  # a scheduler came back: queued requests may go to it
        if control is not None:
            control.links_changed()

    link = SchedulerLink(spec, log, on_change=on_change)
    lifecycle = Lifecycle(health_servicer, link)
    link.on_load = lambda state, report: metrics.observe_load(state.address.model_name, state.address.group, report)
    link.on_lost = lambda state: metrics.scheduler_lost(state.address.model_name, state.address.group)
    link.rejected.on_count = metrics.frontend_rejected
    models = ModelCatalog(link, spec.default_model, spec.aliases)
    authenticator = Authenticator(spec.tenants)
    ledger = UsageLedger(spec.state_dir, log)
    meter = Meter(ledger, metrics, log)
    admission = AdmissionController(link, spec.admission, metrics, spec.tenants)
    tokenize = TokenizePool()
    publisher = None
    if spec.kv_events_endpoint:  # the box's KV events for routers outside it
        try:
            publisher = KVEventsPublisher(spec.kv_events_endpoint, spec.kv_events_replay_endpoint,
                                          spec.kv_events_topic, log)  # fmt: skip
        except zmq.ZMQError as error:
            raise PortInUse(f"kv_events_endpoint: cannot bind {spec.kv_events_endpoint} or "
                            f"{spec.kv_events_replay_endpoint} ({error})") from None  # fmt: skip
        publisher.start()
        link.on_kv_events = lambda state, events: publisher.publish(
            state.address.model_name, state.address.worker_id, state.ready.page_size if state.ready else 16, events
        )
    # A request of our crashed predecessor ended on its scheduler: its interrupted row gets the final counts.
    link.on_orphan_finished = lambda state, delta: meter.settle_orphan(delta)

    server = grpc.aio.server(
        # The funnel outermost: it also answers what goes wrong in authentication, and decodes for everyone.
        interceptors=[
            ErrorInterceptor(log),
            AuthInterceptor(authenticator, spec.admin_token_sha256, spec.admin_token_path),
        ],
        options=[
            ("grpc.max_receive_message_length", spec.max_request_bytes),
            ("grpc.so_reuseport", 0),  # a second server on our port must fail, not share it
        ],
    )
    generation = GenerationService(link, models, lifecycle, metrics, meter, admission, tokenize, log,
                                   spec.disagg_min_prompt_tokens)  # fmt: skip
    pb_grpc.add_GenerationServicer_to_server(generation, server)
    admin = AdminService(link, lifecycle, ledger.path)
    pb_grpc.add_AdminServicer_to_server(admin, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    service_names = [
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        pb.DESCRIPTOR.services_by_name["Admin"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    ]
    enable_reflection(service_names, server)  # v1 and v1alpha
    try:
        server.add_insecure_port(host_port(spec.host, spec.grpc_port))
    except RuntimeError as error:
        raise PortInUse(f"grpc_port: cannot listen on {host_port(spec.host, spec.grpc_port)} ({error})") from None
    await lifecycle.refresh_health()  # NOT_SERVING until every scheduler said it is ready
    await link.start()
    if spec.control_address:
        control = ControlLink(link, spec.control_address, spec.daemon_control_address,
                              read_secret(spec.secret_path), log)  # fmt: skip
        control.on_tenants = lambda tenants: apply_tenants(tenants, authenticator, admission, log)
        await control.start()
    admin.control = control
    autoscaling = None
    if control is not None:  # it scales the box's workers, or (autoscale_max_workers 0) exports its decisions
        autoscaler = Autoscaler(spec, link, admission, control, metrics, log)
        if spec.autoscale.enabled:  # GetLoad's decisions are the ones the daemon carries out
            admin.autoscaler = autoscaler
        inputs = autoscaler.inputs
        generation.on_finished = inputs.request_finished
        link.on_load = lambda state, report: (
            metrics.observe_load(state.address.model_name, state.address.group, report),
            inputs.load_reported(state.address.model_name, state.address.worker_id, report),
        )
        autoscaling = asyncio.create_task(autoscaler.run_forever(), name="autoscaler")
    await server.start()
    checkpoints = asyncio.create_task(meter.checkpoint_forever(), name="usage-checkpoints")
    if spec.metrics_port is not None:
        try:
            metrics.serve(spec.host, spec.metrics_port, spec.metrics_token_sha256)
        except OSError as error:
            where = host_port(spec.host, spec.metrics_port)
            raise PortInUse(f"metrics_port: cannot listen on {where} ({error})") from None
    if spec.metrics_socket:
        metrics.serve_socket(spec.metrics_socket)  # the gateway's /metrics serves them from here
    mark_listening(spec.listening_path)
    log.info("frontend_listening", grpc_port=spec.grpc_port, metrics_port=spec.metrics_port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()

    log.info("draining", in_flight=lifecycle.in_flight, timeout_s=spec.drain_timeout_s)
    await lifecycle.begin_drain()
    if not await lifecycle.wait_idle(spec.drain_timeout_s):
        log.warning("drain_timeout", aborted=lifecycle.in_flight)
        link.fail_all("server is shutting down; retry on another instance")
        await lifecycle.wait_idle(5.0)
    await server.stop(grace=2.0)
    await meter.settled(timeout=0.5)  # aborted and cancelled requests' final counts arrive and are metered
    checkpoints.cancel()
    if autoscaling is not None:
        autoscaling.cancel()
    admission.close()
    tokenize.close()
    generation.grammars.close()
    if control is not None:
        control.close()
    if publisher is not None:
        publisher.close()
    link.close()
    ledger.close()
    log.info("frontend_stopped")
