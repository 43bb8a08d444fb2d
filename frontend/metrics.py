"""Prometheus metrics, named like vLLM's with a `tokend:` prefix, served as text on /metrics.

Per-scheduler gauges and counters come from the schedulers' load reports; request latencies and token
totals are observed here, where the client's experience is.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from frontend.iteration_tokens import IterationTokens
from frontend.metrics_server import start_metrics_server, start_socket_metrics_server
from frontend.request_phases import RequestPhases
from gpu_runtime.ipc.enums import Priority
from gpu_runtime.ipc.messages import LoadReport
from gpu_runtime.ipc.rejected_messages import FORGED, MALFORMED

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# vLLM's request phase buckets (from 0.3 s up), with finer ones below: a small model's phases take milliseconds.
_PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                  40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vLLM's 1-2-5 series (it stops at the model's context length; several models share these).
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class FrontendMetrics:
    def __init__(self, tenant_metrics: bool = False) -> None:
        # Process-wide: a `_created` series per counter and histogram doubles the text and no dashboard reads it.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        scheduler = ["model_name", "group"]
        model = ["model_name"]
        r = self.registry
        self.num_requests_running = Gauge(
            "tokend:num_requests_running", "Requests in the scheduler's running batch", scheduler, registry=r
        )
        self.num_requests_waiting = Gauge(
            "tokend:num_requests_waiting", "Requests waiting in the scheduler's queue", scheduler, registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            "tokend:kv_cache_usage_perc",
            "Share of KV cache pages held by live sequences (1 = full)",
            scheduler,
            registry=r,
        )
        self.projected_ttft_seconds = Gauge(
            "tokend:projected_ttft_seconds",
            "Worst projected time to first token of a waiting request",
            scheduler,
            registry=r,
        )
        self.scheduler_up = Gauge("tokend:scheduler_up", "1 while the scheduler is ready", scheduler, registry=r)
        self.prefix_cache_queries = Counter(
            "tokend:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", scheduler, registry=r
        )
        self.prefix_cache_hits = Counter(
            "tokend:prefix_cache_hits", "Prompt tokens found in the prefix cache", scheduler, registry=r
        )
        self.prefix_cache_host_hits = Counter(
            "tokend:prefix_cache_host_hits",
            "Prompt tokens found in the host KV tier (counted in tokend:prefix_cache_hits too)",
            scheduler,
            registry=r,
        )
        self.kv_offloaded_pages = Counter(
            "tokend:kv_offloaded_pages", "KV pages copied to the host tier as the KV cache evicted them", scheduler,
            registry=r,
        )  # fmt: skip
        self.kv_host_loaded_pages = Counter(
            "tokend:kv_host_loaded_pages", "KV pages loaded back from the host tier for a prompt", scheduler,
            registry=r,
        )  # fmt: skip
        self.kv_host_tier_pages = Gauge(
            "tokend:kv_host_tier_pages", "KV pages held in the host tier", scheduler, registry=r
        )
        self.num_preemptions = Counter(
            "tokend:num_preemptions", "Sequences preempted to free KV pages", scheduler, registry=r
        )
        # Disaggregated serving, counted on the decode workers that pull (vLLM's NIXL connector reports the same).
        self.kv_transfer_pages = Counter(
            "tokend:kv_transfer_pages", "KV pages pulled from prefill workers", scheduler, registry=r
        )
        self.kv_transfer_bytes = Counter(
            "tokend:kv_transfer_bytes", "Bytes of KV pages pulled from prefill workers", scheduler, registry=r
        )
        self.kv_transfer_seconds = Counter(
            "tokend:kv_transfer_seconds", "Seconds spent pulling KV pages from prefill workers", scheduler, registry=r
        )
        self.kv_transfer_failures = Counter(
            "tokend:kv_transfer_failures", "KV page pulls that failed (then recomputed or failed)", scheduler,
            registry=r,
        )  # fmt: skip
        self.kv_leases_held = Gauge(
            "tokend:kv_leases_held", "Prompts whose KV pages a prefill worker keeps for a decode worker", scheduler,
            registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter("tokend:prompt_tokens", "Prompt tokens of finished requests", model, registry=r)
        self.generation_tokens = Counter(
            "tokend:generation_tokens", "Tokens generated, aborted requests included", model, registry=r
        )
        self.request_success = Counter(
            "tokend:request_success", "Requests that ended, by finish reason", [*model, "finished_reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "tokend:time_to_first_token_seconds", "Arrival to first token", model, buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "tokend:inter_token_latency_seconds",
            "Time between streamed tokens",
            model,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "tokend:e2e_request_latency_seconds", "Arrival to last token", model, buckets=_E2E_BUCKETS, registry=r
        )
        # vLLM's request phases, observed once per finished request (queue + inference ~= e2e, less tokenizing).
        self.request_queue_time = Histogram(
            "tokend:request_queue_time_seconds",
            "Waiting: in the frontend's admission, then in the scheduler's queue, until its first scheduled step",
            model,
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.request_prefill_time = Histogram(
            "tokend:request_prefill_time_seconds",
            "First scheduled step to first token",
            model,
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.request_decode_time = Histogram(
            "tokend:request_decode_time_seconds", "First token to last token", model, buckets=_PHASE_BUCKETS, registry=r
        )
        self.request_inference_time = Histogram(
            "tokend:request_inference_time_seconds",
            "First scheduled step to last token (prefill plus decode)",
            model,
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.request_prompt_tokens = Histogram(
            "tokend:request_prompt_tokens",
            "Prompt tokens per finished request",
            model,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "tokend:request_generation_tokens",
            "Generated tokens per finished request",
            model,
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.iteration_tokens = IterationTokens()
        r.register(self.iteration_tokens)
        # The autoscaler's decision, for an HPA or KEDA to act on across machines (on one box the daemon acts).
        self.desired_replicas = Gauge(
            "tokend:desired_replicas", "Serving workers the autoscaler wants", ["model_name", "role"], registry=r
        )
        self.desired_standby = Gauge(
            "tokend:desired_standby", "Warm standby workers the autoscaler wants beside the serving ones",
            ["model_name", "role"], registry=r,
        )  # fmt: skip
        self.autoscaler_decisions = Counter(
            "tokend:autoscaler_decisions", "Autoscaler changes by direction and reason", ["direction", "reason"],
            registry=r,
        )  # fmt: skip
        self.worker_warmup_seconds = Histogram(
            "tokend:worker_warmup_seconds",
            "A worker's start to its first serving loop (load and warm-up), measured",
            ["model_name"],
            buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
            registry=r,
        )
        tenant = ["tenant", "model_name"]
        # Tenant names and their usage are for the operator: served only when asked for (tenant_metrics), else
        # counted in a registry nobody serves.
        r = self.registry if tenant_metrics else CollectorRegistry()
        self.tenant_requests = Counter(
            "tokend:tenant_requests", "Requests per tenant by ledger status", [*tenant, "status"], registry=r
        )
        self.tenant_prompt_tokens = Counter(
            "tokend:tenant_prompt_tokens", "Prompt tokens per tenant", tenant, registry=r
        )
        self.tenant_completion_tokens = Counter(
            "tokend:tenant_completion_tokens", "Completion tokens per tenant", tenant, registry=r
        )
        self.tenant_cached_tokens = Counter(
            "tokend:tenant_cached_tokens", "Prompt tokens served from the prefix cache, per tenant", tenant, registry=r
        )
        r = self.registry
        self.admission_admitted = Counter(
            "tokend:admission_admitted", "Requests sent to a scheduler, by class", ["priority"], registry=r
        )
        self.admission_queued = Counter(
            "tokend:admission_queued", "Requests that had to wait for a slot, by class", ["priority"], registry=r
        )
        self.admission_shed = Counter(
            "tokend:admission_shed", "Requests refused or dropped under pressure", ["priority", "reason"], registry=r
        )
        self.admission_queue_depth = Gauge(
            "tokend:admission_queue_depth", "Requests waiting for a slot, by class", ["priority"], registry=r
        )
        for priority in Priority:  # present from the start: a router reads a missing series as no data, not 0
            self.admission_queue_depth.labels(priority.label).set(0)
        self.admission_batch_slots = Gauge(
            "tokend:admission_batch_slots",
            "Slots batch requests may hold now: the ready schedulers' slots less interactive work's peak demand "
            "over the last few seconds",
            model,
            registry=r,
        )
        self.structured_output_compile_seconds = Histogram(
            "tokend:structured_output_compile_seconds",
            "Compiling a structured output's spec (schema, regex, choice, grammar) not in the cache, in the frontend",
            ["kind"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=r,
        )
        self.structured_output_cache_hits = Counter(
            "tokend:structured_output_cache_hits", "Structured output specs found compiled in the cache", ["kind"],
            registry=r,
        )  # fmt: skip
        self.structured_output_rejected = Counter(
            "tokend:structured_output_rejected",
            "Structured output specs refused before admission, by reason (invalid, too_large, too_slow)",
            ["kind", "reason"],
            registry=r,
        )
        self.requests_in_flight = Gauge("tokend:requests_in_flight", "Generate calls open in the frontend", registry=r)
        self.ipc_messages_rejected = Counter(
            "tokend:ipc_messages_rejected",
            "Messages refused on the frontend-scheduler channels, by receiver (frontend or a worker) and reason "
            "(malformed, forged): peers never send either",
            ["receiver", "reason"],
            registry=r,
        )
        # Cumulative counters in the last report of each scheduler incarnation, to turn reports into increments.
        self._last_counts: dict[tuple[str, str], tuple[str, tuple[float, ...]]] = {}
        self._last_rejections: dict[str, tuple[str, int, int]] = {}  # worker id: (incarnation, malformed, forged)

    def serve(self, host: str, port: int, token_sha256: str = "") -> None:
        start_metrics_server(host, port, self.registry, token_sha256)

    def serve_socket(self, path: str) -> None:
        """The same text on a Unix socket in the daemon's private directory, for the gateway's /metrics."""
        start_socket_metrics_server(path, self.registry)

    def observe_finished(self, model_name: str, phases: RequestPhases, prompt_tokens: int, output_tokens: int) -> None:
        self.request_queue_time.labels(model_name).observe(phases.queue_s)
        self.request_prefill_time.labels(model_name).observe(phases.prefill_s)
        self.request_decode_time.labels(model_name).observe(phases.decode_s)
        self.request_inference_time.labels(model_name).observe(phases.prefill_s + phases.decode_s)
        self.request_prompt_tokens.labels(model_name).observe(prompt_tokens)
        self.request_generation_tokens.labels(model_name).observe(output_tokens)

    def observe_load(self, model_name: str, group: str, report: LoadReport) -> None:
        labels = (model_name, group)
        self.num_requests_running.labels(*labels).set(report.num_running)
        self.num_requests_waiting.labels(*labels).set(report.num_waiting)
        self.kv_cache_usage_perc.labels(*labels).set(report.kv_cache_usage)
        self.projected_ttft_seconds.labels(*labels).set(report.projected_ttft_seconds)
        self.scheduler_up.labels(*labels).set(1)
        self.iteration_tokens.observe(labels, report)
        self.kv_leases_held.labels(*labels).set(report.kv_leases_held)
        self.kv_host_tier_pages.labels(*labels).set(report.kv_host_pages)
        counters = (
            (self.prefix_cache_queries, report.prefix_query_tokens),
            (self.prefix_cache_hits, report.prefix_hit_tokens),
            (self.prefix_cache_host_hits, report.prefix_host_hit_tokens),
            (self.kv_offloaded_pages, report.kv_offloaded_pages),
            (self.kv_host_loaded_pages, report.kv_loaded_pages),
            (self.num_preemptions, report.num_preemptions),
            (self.kv_transfer_pages, report.kv_pulled_pages),
            (self.kv_transfer_bytes, report.kv_pulled_bytes),
            (self.kv_transfer_seconds, report.kv_pull_seconds),
            (self.kv_transfer_failures, report.kv_pull_failures),
        )
        incarnation, before = self._last_counts.get(labels, (report.incarnation, (0,) * len(counters)))
        if incarnation != report.incarnation:  # a restarted scheduler counts from zero again
            before = (0,) * len(counters)
        for (counter, total), last in zip(counters, before, strict=True):
            counter.labels(*labels).inc(max(0, total - last))
        self._last_counts[labels] = (report.incarnation, tuple(total for _, total in counters))
        self._count_rejections(report)

    def _count_rejections(self, report: LoadReport) -> None:
        incarnation, malformed, forged = self._last_rejections.get(report.worker_id, (report.incarnation, 0, 0))
        if incarnation != report.incarnation:
            malformed = forged = 0
        for reason, total, last in ((MALFORMED, report.messages_malformed, malformed),
                                    (FORGED, report.messages_forged, forged)):  # fmt: skip
            if total > last:
                self.ipc_messages_rejected.labels(report.worker_id, reason).inc(total - last)
        self._last_rejections[report.worker_id] = (report.incarnation, report.messages_malformed,
                                                   report.messages_forged)  # fmt: skip

    def frontend_rejected(self, reason: str) -> None:
        self.ipc_messages_rejected.labels("frontend", reason).inc()

    def scheduler_lost(self, model_name: str, group: str) -> None:
        """A dead scheduler holds nothing: its gauges go back to their baseline."""
        labels = (model_name, group)
        for gauge in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                      self.kv_leases_held):  # fmt: skip
            gauge.labels(*labels).set(0)
        self.projected_ttft_seconds.labels(*labels).set(0)
        self.scheduler_up.labels(*labels).set(0)
