"""Which tier each test file is in: `fast` (no model, no process), `engine` (tiny models in process), `daemon`
(real processes: a daemon, a rank, a CLI or any other interpreter). conftest marks every test from this table.

A file is in the heaviest tier any of its tests needs, so that `-m fast` never starts a process and `-m engine`
never starts a daemon. A new test file goes in here (or marks itself with `pytestmark = pytest.mark.<tier>`):
one in neither fails collection, naming the file, rather than silently running in no tier.
"""

from __future__ import annotations

TIER_MARKERS = {
    "fast": "no model, no process: pure logic over fakes (the edit loop: scripts/test -m fast)",
    "engine": "tiny models (checkpoints written by transformers) run in this process",
    "daemon": "real processes: tokend serve, its children, a CLI or a rank process",
}

_FAST = """
    admission_hints autoscale_inputs autoscale_policy chat_template config_reload control_channel error_interceptor
    gateway_keepalive gguf_malformed grafana_dashboard health_states host_tier iteration_tokens kv_events_wire
    kv_groups kv_leases kv_pull_transports model_config page_allocator page_allocator_cases pooling_config
    prefix_routing proto_api rollout_plan routing sampling_params scaling_plan scheduler scheduler_keepalive
    scheduler_state_machine text_stream window_pages
"""
_ENGINE = """
    attention_backends cpu_weights engine_exactness engine_phase_timings engine_requests generation_defaults gguf gpu
    embeddings_engine kv_transfer latency load_progress loader memory_budget meta_loading penalties prefix_caching
    prompt_logprobs sampler scheduler_priority serve_config static_batching step_oom
"""
_DAEMON = """
    admission autoscale bench_serving chaos_script chat_template_transformers cli default_model default_model_real
    deploy_systemd disaggregated dockerfile embeddings_served gateway_hardening gateway_openai gguf_families
    gpu_check gpu_pinning grpc_reflection ipc_hardening kubernetes_manifests kv_events_served liveness logs metering
    metrics_api_port model_families_served multi_model openai_surface perf_report playground_browser process_imports
    request_id rollout rollout_commands sampling_served serve_cancel serve_errors serve_flags serve_host serve_ipc
    serve_lifecycle serve_readiness serve_streaming sighup_reload sim_autoscale tenant_isolation tenants
    tensor_parallel_daemon tensor_parallel_engine tensor_parallel_model tokenize_off_loop
"""

# Test file (its path under tests/) -> tier.
TIERS: dict[str, str] = {
    f"test_{name}.py": tier
    for tier, names in (("fast", _FAST), ("engine", _ENGINE), ("daemon", _DAEMON))
    for name in names.split()
} | {
    "gpu/test_sections.py": "daemon",  # two sections run a benchmark's process
}
