"""FrontendSpec: everything the frontend process needs, passed by the daemon as a JSON file in its private runtime
directory (only the file's path is on the command line, which `ps` shows to every user)."""

from __future__ import annotations

import math
from typing import Annotated

import msgspec


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class SchedulerAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    worker_id: str
    model_name: str
    group: str
    input_address: str  # ipc:// the scheduler binds


class TenantSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    api_key_sha256: str  # hex SHA-256 of the key
    priority: str = "interactive"  # the class its requests get when they do not ask for one
    max_priority: str = "interactive"  # the most urgent class it may ask for
    max_concurrent: int = 0  # requests in flight at once; 0 = unlimited
    tokens_per_minute: int = 0  # prompt plus completion tokens; 0 = unlimited
    models: list[str] = []  # the models it may use; empty = all
    admin: bool = False  # may call the Admin service
    # Tenants with the same cache group share cached prompt pages (e.g. a common system prompt); "" = its own.
    cache_group: str = ""
    # Structured outputs: the largest spec in bytes and the longest compile in milliseconds its requests may ask
    # for; 0 = the server's limits (64 KiB, 500 ms).
    max_structured_output_bytes: int = 0
    max_grammar_compile_ms: float = 0

    def __post_init__(self) -> None:
        for key in ("max_structured_output_bytes", "max_grammar_compile_ms"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"tenants.{self.name}.{key}: must be a number >= 0 (0 = the server's), got {value!r}")

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models


class AdmissionSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Priority admission: per-class time-to-first-token targets, and how much may wait.

    The field names are `tokend serve`'s config keys, and the descriptions their `--help` text."""

    interactive_ttft_target: Annotated[
        float, _doc("seconds; when interactive work would miss it, queued batch work is shed to make way")
    ] = 2.0
    batch_ttft_target: Annotated[
        float, _doc("seconds; beyond it, batch work waits (up to batch_max_queue_wait) or is shed")
    ] = 30.0
    max_queued_requests: Annotated[
        int, _doc("requests waiting for a slot, both classes; when full, the newest batch request is shed")
    ] = 256
    batch_max_queue_wait: Annotated[float, _doc("seconds; a batch request waiting this long for a slot is shed")] = 60.0

    def __post_init__(self) -> None:
        for key in ("interactive_ttft_target", "batch_ttft_target", "batch_max_queue_wait"):
            value = getattr(self, key)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{key}: must be seconds >= 0, got {value!r}")
        value = self.max_queued_requests
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"max_queued_requests: must be an integer >= 1, got {value!r}")


class AutoscaleSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The autoscaler (common.autoscale_policy), run by the frontend on its queues and the workers' load reports;
    the daemon starts and drains the workers it asks for. The field names are `tokend serve`'s config keys."""

    autoscale_max_workers: Annotated[
        int, _doc("serving workers per model at most (spare_devices give the groups); 0 turns the autoscaler off")
    ] = 0
    autoscale_min_workers: Annotated[int, _doc("serving workers per model at least")] = 1
    min_standby: Annotated[
        int, _doc("workers per model kept loaded and warm but not routed: a scale-up promotes one at once")
    ] = 0
    autoscale_ttft_fraction: Annotated[
        float, _doc("scale up when projected TTFT plus queue wait would pass this share of interactive_ttft_target")
    ] = 0.8
    autoscale_scale_down_delay: Annotated[
        float, _doc("seconds the load must stay quiet before one serving worker drains")
    ] = 60.0
    autoscale_peak_rps: Annotated[
        float,
        _doc("requests/s expected at peak: warm workers (serving and standby) are held for it, so that a burst is "
             "served by promotions instead of cold starts; 0 holds only what the recent peak needs"),
    ] = 0.0  # fmt: skip
    autoscale_peak_memory: Annotated[
        float, _doc("seconds the busiest arrival rate seen is remembered as a peak to hold warm workers for")
    ] = 3600.0
    autoscale_headroom: Annotated[
        float,
        _doc("workers beyond a load's rate over one worker's capacity, in units of its square root (square-root "
             "staffing): the fleet for a peak is a + headroom * sqrt(a); 0.2 is what simulated fleets measured"),
    ] = 0.2  # fmt: skip

    def __post_init__(self) -> None:
        for key in ("autoscale_max_workers", "min_standby"):
            value = getattr(self, key)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{key}: must be an integer >= 0, got {value!r}")
        if not (isinstance(self.autoscale_min_workers, int) and self.autoscale_min_workers >= 1):
            raise ValueError(f"autoscale_min_workers: must be an integer >= 1, got {self.autoscale_min_workers!r}")
        if self.autoscale_max_workers and self.autoscale_max_workers < self.autoscale_min_workers:
            raise ValueError(f"autoscale_max_workers: {self.autoscale_max_workers} is below autoscale_min_workers "
                             f"({self.autoscale_min_workers})")  # fmt: skip
        if not 0 < self.autoscale_ttft_fraction <= 1:
            raise ValueError(f"autoscale_ttft_fraction: must be in (0, 1], got {self.autoscale_ttft_fraction!r}")
        delay = self.autoscale_scale_down_delay
        if not delay >= 0:
            raise ValueError(f"autoscale_scale_down_delay: must be seconds >= 0, got {delay!r}")
        for key in ("autoscale_peak_rps", "autoscale_peak_memory", "autoscale_headroom"):
            value = getattr(self, key)
            if not (isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < math.inf):
                raise ValueError(f"{key}: must be a finite number >= 0, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.autoscale_max_workers > 0


METRICS_SOCKET_FILE = "metrics.sock"  # in the daemon's runtime directory: FrontendSpec.metrics_socket


class FrontendSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    grpc_port: int
    metrics_port: int | None  # None: no /metrics endpoint
    output_address: str  # ipc:// this process binds; every scheduler pushes its outputs here
    schedulers: list[SchedulerAddress]
    default_model: str
    # The daemon's per-boot secret file (gpu_runtime.ipc.peer_auth): signs our hellos, checks the schedulers'
    # readies. The path, never the secret: this spec travels on a command line, which `ps` shows to everyone.
    secret_path: str
    drain_timeout_s: float = 30.0
    # A scheduler whose load reports stop this long (or a few of its recent steps, if longer) takes no new work.
    liveness_timeout_s: float = 2.0
    max_request_bytes: int = 4 * 1024 * 1024
    log_level: str = "info"
    tenants: list[TenantSpec] = []  # empty: authentication is off
    state_dir: str = "."  # where the usage ledger lives
    aliases: dict[str, str] = {}  # another name of a model -> its name
    admission: AdmissionSpec = AdmissionSpec()
    autoscale: AutoscaleSpec = AutoscaleSpec()
    host: str = "127.0.0.1"  # where the gRPC and metrics listeners bind
    tenant_metrics: bool = False  # per-tenant series on /metrics (tenant names and usage)
    metrics_token_sha256: str = ""  # hex SHA-256 of the bearer token /metrics requires; "" = none
    # A Unix socket in the daemon's private directory where the metrics are served too, for the gateway's /metrics
    # ("" = none). Served whether or not metrics_port is.
    metrics_socket: str = ""
    # Created once this process's own listeners are bound: the daemon's proof that they are ours ("" = none).
    listening_path: str = ""
    # The control channel with the daemon (frontend.control_messages): the worker set, rollouts, tenant reloads.
    # "" = none: the schedulers above are the whole, fixed set.
    control_address: str = ""  # ipc:// this process binds
    daemon_control_address: str = ""  # ipc:// the daemon binds
    # A model with prefill and decode workers sends prompts at least this long to a prefill worker first.
    disagg_min_prompt_tokens: int = 64
    # Prefix-aware routing: the weight of the prefill of a prompt's uncached tokens in the routing key (0: none).
    prefix_routing_weight: float = 1.0
    # The box's KV events for routers outside it (frontend/kv_events_publisher.py): "" = not published.
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""
    # The boot's local admin token (daemon.admin_token) as its hex SHA-256, and the file the CLI reads the token
    # from (named in a refusal). With no tenants, Drain and Rollout need it; with tenants it is an admin's key.
    # "" = none (a frontend run alone): with no tenants those RPCs are then refused to everyone.
    admin_token_sha256: str = ""
    admin_token_path: str = ""

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str) -> FrontendSpec:
        return msgspec.json.decode(text, type=cls)


def spec_text(argument: str) -> str:
    """A child's spec from its command-line argument: the JSON itself (a test, `python -m frontend '{...}'`) or
    the path of the 0600 file the daemon wrote it to, so that tenant key hashes never reach argv."""
    if argument.lstrip().startswith("{"):
        return argument
    with open(argument, encoding="utf-8") as file:
        return file.read()
