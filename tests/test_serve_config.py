"""`tokend serve` configuration: flags over the TOML file over defaults, and errors that name the key."""

from __future__ import annotations

import re

import pytest

from common.lanes import DrainAction, KVLoadFailure, KVTransport
from daemon.cli import build_parser
from daemon.config import ServeConfig, load_serve_config
from frontend.spec import AdmissionSpec
from gpu_runtime.engine_config import EngineConfig


def _load(*argv: str) -> ServeConfig:
    return load_serve_config(build_parser().parse_args(["serve", *argv]))


def test_defaults_work_on_a_laptop():
    config = _load()
    assert (config.grpc_port, config.metrics_port, config.model, config.devices) == (50051, 9401, (), ["auto"])
    # The engine's defaults are EngineConfig's own, its identity left for each scheduler to fill in.
    assert config.engine == EngineConfig()
    assert (config.engine.model, config.engine.served_model_name, config.engine.device) == (None, None, "auto")
    assert config.admission == AdmissionSpec()


def test_flags_override_the_file_which_overrides_defaults(tmp_path):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(
        'grpc_port = 6000\nmax_num_seqs = 8\nkv_cache_bytes = 1048576\ndevice = "cpu,cpu"\nmax_queued_requests = 9\n'
    )
    config = _load("--config", str(config_file), "--max-num-seqs", "16", "--batch-ttft-target", "5")
    assert (config.grpc_port, config.engine.max_num_seqs, config.engine.kv_cache_bytes) == (6000, 16, 1048576)
    assert (config.admission.max_queued_requests, config.admission.batch_ttft_target) == (9, 5.0)
    assert config.devices == ["cpu", "cpu"]


def test_model_may_be_one_path_or_a_list_in_the_file(tmp_path, llama_dir):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(f'model = "{llama_dir}"\nserved_model_name = "small"\n')
    assert _load("--config", str(config_file)).model == (str(llama_dir),)
    config_file.write_text(f'model = ["{llama_dir}", "{llama_dir}"]\n')
    assert len(_load("--config", str(config_file)).model) == 2


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("max_num_seqs = 0", "max_num_seqs"),
        ("metrics_port = -1", "metrics_port"),
        ('scheduling = "greedy"', "scheduling"),
        ("drain_timeout = -5", "drain_timeout"),
        ('log_level = "loud"', "log_level"),
        ("kv_cache_bytes = 0", "kv_cache_bytes"),
        ("cpu_threads = -1", "cpu_threads"),
        ("grpc_port = true", "grpc_port"),
        ("no_such_option = 1", "no_such_option"),
        ("max_num_seqs = ", "config"),
        ("max_num_seqs = 64\nmax_num_batched_tokens = 8", "max_num_batched_tokens"),
        ("page_size = 12", "page_size"),
        ("gpu_memory_utilization = 1.5", "gpu_memory_utilization"),
        ('enable_prefix_caching = "no"', "enable_prefix_caching"),
        ("ttft_slo_ms = -1", "ttft_slo_ms"),
        ('attention_backend = "flash"', "attention_backend"),
        ("max_queued_requests = 0", "max_queued_requests"),
        ("batch_max_queue_wait = -1.0", "batch_max_queue_wait"),
        ("debug_checks = true", "debug_checks"),
    ],
)
def test_a_bad_key_is_named(tmp_path, toml, key):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(toml + "\n")
    with pytest.raises(ValueError, match=f"^{key}"):
        _load("--config", str(config_file))


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="^config: cannot read"):
        _load("--config", str(tmp_path / "absent.toml"))


def test_models_tables_name_the_served_models_default_first(tmp_path, llama_dir):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(
        f'[[models]]\nname = "a"\naliases = ["x"]\n\n[[models]]\nname = "b"\npath = "{llama_dir}"\ngroups = ["cpu"]\n'
    )
    models = _load("--config", str(config_file)).served_models()
    assert [(m.name, m.path, m.aliases, m.groups) for m in models] == [
        ("a", None, ["x"], []),
        ("b", str(llama_dir), [], ["cpu"]),
    ]


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ('[[models]]\nname = "a"\naliases = ["a"]\n', "models[0].name"),
        ('[[models]]\nname = "a"\npath = "/nowhere"\n', "models[0].path"),
        ('[[models]]\nname = "a"\nsize = 7\n', "models[0]"),
        ('model = "/x"\n[[models]]\nname = "a"\n', "model"),
        ('[[tenants]]\nname = "t"\napi_key_sha256 = "abc"\n', "tenants[0].api_key_sha256"),
        ('[[tenants]]\nname = "t"\napi_key_sha256 = "' + "a" * 64 + '"\npriority = "urgent"\n', "tenants[0].priority"),
    ],
)
def test_a_bad_table_is_named(tmp_path, toml, key):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(toml)
    with pytest.raises(ValueError, match=f"^{re.escape(key)}"):
        _load("--config", str(config_file))


def test_tenants_file_adds_its_tenants_to_the_configs(tmp_path):
    """Keys kept apart from the config (a Kubernetes Secret, a 0600 file) join the config's own tenants."""
    config, secret = tmp_path / "tokend.toml", tmp_path / "tenants.toml"
    config.write_text(f'tenants_file = "{secret}"\n[[tenants]]\nname = "ops"\napi_key_sha256 = "{"a" * 64}"\n')
    secret.write_text(f'[[tenants]]\nname = "web"\napi_key_sha256 = "{"b" * 64}"\npriority = "batch"\n')
    tenants = _load("--config", str(config)).tenants
    assert [(t.name, t.priority) for t in tenants] == [("ops", "interactive"), ("web", "batch")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('host = "0.0.0.0"\n', "may hold only [[tenants]] tables, not 'host'"),
        ("[[tenants]]\nname = 3\n", "tenants[0]"),
        ("[[tenants\n", "is not valid TOML"),
    ],
)
def test_a_bad_tenants_file_is_named(tmp_path, content, message):
    secret = tmp_path / "tenants.toml"
    secret.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        _load("--tenants-file", str(secret))
    with pytest.raises(ValueError, match="tenants_file: cannot read"):
        _load("--tenants-file", str(tmp_path / "absent.toml"))


@pytest.mark.parametrize(
    ("key", "text", "member"),
    [
        ("kv_transfer_transport", "zmq", KVTransport.ZMQ),
        ("kv_load_failure", "fail", KVLoadFailure.FAIL),
        ("on_drain_timeout", "migrate", DrainAction.MIGRATE),
    ],  # fmt: skip
)
def test_an_enum_option_from_a_flag_or_the_file_is_its_member_and_a_bad_one_is_named(tmp_path, key, text, member):
    flag = "--" + key.replace("_", "-")
    assert getattr(_load(flag, text), key) is member
    config = tmp_path / "tokend.toml"
    config.write_text(f'{key} = "{text}"\n')
    assert getattr(_load("--config", str(config)), key) is member
    config.write_text(f'{key} = "sideways"\n')  # the file's text was once taken as it was
    choices = "|".join(type(member))
    with pytest.raises(ValueError, match=re.escape(f"{key}: must be one of {choices}, got 'sideways'")):
        _load("--config", str(config))
    with pytest.raises(ValueError, match=re.escape(f"{key}: must be one of {choices}, got 'sideways'")):
        _load(flag, "sideways")


@pytest.mark.parametrize("roles", [("--device", "cpu=prefill,cpu=decode"), ("--spare-devices", "cpu=prefill")])
def test_tensor_parallelism_beside_prefill_or_decode_roles_is_refused_naming_both_keys(roles, capsys):
    from daemon.cli import main

    # Refused before anything starts: a handover would move only rank 0's KV shard.
    assert main(["serve", "--tensor-parallel-size", "2", *roles]) == 78
    error = capsys.readouterr().err
    assert "tensor_parallel_size" in error and roles[0].removeprefix("--").replace("-", "_") in error
    assert "=prefill" in error


def test_the_worker_start_timeout_and_model_roots_are_options(tmp_path):
    config = _load("--worker-start-timeout", "90", "--model-roots", "/srv/models", "--model-roots", "/opt/m")
    assert (config.worker_start_timeout, config.model_roots) == (90.0, ("/srv/models", "/opt/m"))
    assert _load().worker_start_timeout == 600.0
    config_file = tmp_path / "tokend.toml"
    config_file.write_text('model_roots = "/srv/models"\n')
    assert _load("--config", str(config_file)).rollout_roots() == ["/srv/models"]
    with pytest.raises(ValueError, match="^worker_start_timeout:"):
        _load("--worker-start-timeout", "0")


def test_a_config_or_tenants_file_others_may_read_is_warned_about_at_start(tmp_path):
    from worker_fakes import FakeLog

    from daemon.serve_command import warn_if_readable_by_others

    config, tenants, private = tmp_path / "tokend.toml", tmp_path / "tenants.toml", tmp_path / "private.toml"
    for path, mode in ((config, 0o644), (tenants, 0o640), (private, 0o600)):
        path.write_text("")
        path.chmod(mode)
    log = FakeLog()
    warn_if_readable_by_others(log, {"config": str(config), "tenants_file": str(tenants), "other": str(private)})
    warned = [(level, event, fields["key"], fields["mode"]) for level, event, fields in log.entries]
    assert warned == [("warning", "file_readable_by_others", "config", "0o644"),
                      ("warning", "file_readable_by_others", "tenants_file", "0o640")]  # fmt: skip


def test_metrics_need_the_token_beyond_loopback_with_tenants(tmp_path):
    from frontend.spec import TenantSpec

    tenant = TenantSpec("someone", "0" * 64)
    assert ServeConfig(host="0.0.0.0", tenants=(tenant,)).metrics_need_token
    assert not ServeConfig(host="127.0.0.1", tenants=(tenant,)).metrics_need_token
    assert not ServeConfig(host="0.0.0.0", allow_unauthenticated=True).metrics_need_token
