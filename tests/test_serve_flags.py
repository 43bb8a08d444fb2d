"""`tokend serve`'s options as a user meets them: --help, TOKEND_<KEY> variables, and what reaches each process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
from daemon_harness import ROOT, free_port

from daemon.child_specs import frontend_spec, scheduler_specs
from daemon.cli import build_parser
from daemon.config import ServeConfig, load_serve_config
from frontend.spec import AdmissionSpec, FrontendSpec
from gpu_runtime.default_model import DEFAULT_MODEL_NAME
from gpu_runtime.engine_config import EngineConfig
from gpu_runtime.worker.spec import WorkerSpec

ENGINE_IDENTITY = {"model", "served_model_name", "device", "debug_checks"}


def _load(*argv: str, environ: dict[str, str] | None = None) -> ServeConfig:
    return load_serve_config(build_parser().parse_args(["serve", *argv]), environ=environ or {})


def _cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "daemon.cli", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    return str(default).lower() if isinstance(default, bool) else str(default)


def test_help_lists_every_engine_option_with_its_default():
    result = _cli("serve", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())  # argparse wraps lines at the terminal's width
    fields = [f for f in msgspec.structs.fields(EngineConfig) if f.name not in ENGINE_IDENTITY]
    assert {f.name for f in fields} >= {"page_size", "enable_prefix_caching", "gpu_memory_utilization", "dtype"}
    for field in fields:
        flag = "--" + field.name.replace("_", "-")
        assert f" {flag} " in text or f" {flag}, " in text, flag
        after = text[text.index(f" {flag}") + 1 :]
        assert after.split("(default: ", 1)[1].startswith(_shown(field.default) + ")"), flag
    choices = ("{continuous,static}", "{auto,batched,cpu_paged,torch,triton}")
    for flag in ("--no-enable-prefix-caching", "--no-enable-chunked-prefill", *choices):
        assert flag in text
    assert "--debug-checks" not in text  # TOKEND_DEBUG's, not an operator's


def test_help_shows_every_daemon_and_admission_default():
    text = " ".join(_cli("serve", "--help").stdout.split())
    for key, default in [("grpc-port", "50051"), ("http-port", "8000"), ("log-level", "info"), ("cpu-threads", "0"),
                         ("drain-timeout", "30.0"), ("max-queued-requests", "256"), ("batch-max-queue-wait", "60.0"),
                         ("interactive-ttft-target", "2.0"), ("model", "unset"), ("device", "auto")]:  # fmt: skip
        after = text[text.index(f" --{key} ") + 1 :]
        assert after.split("(default: ", 1)[1].startswith(default + ")"), key


def test_a_bad_combination_exits_78_naming_both_keys_before_anything_starts(tmp_path):
    state_dir = tmp_path / "state"  # the supervisor creates it first thing: it must not exist after
    started = time.monotonic()
    result = _cli("serve", "--max-num-seqs", "64", "--max-num-batched-tokens", "8", "--state-dir", str(state_dir),
                  "--grpc-port", str(free_port()), "--metrics-port", "0", "--http-port", "0")  # fmt: skip
    assert result.returncode == 78
    assert "max_num_seqs" in result.stderr and "max_num_batched_tokens" in result.stderr
    assert "Traceback" not in result.stderr and '"starting"' not in result.stderr
    assert not state_dir.exists(), "the supervisor was built"
    assert time.monotonic() - started < 15


def test_a_toml_key_and_an_env_variable_reach_the_scheduler(tmp_path):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text('page_size = 32\nttft_slo_ms = 250\ndevice = "cpu,cpu"\n')
    config = _load("--config", str(config_file), environ={"TOKEND_ENABLE_PREFIX_CACHING": "false"})
    specs = scheduler_specs(config, tmp_path)
    assert [s.engine.device for s in specs] == ["cpu", "cpu"]
    for spec in specs:
        engine = WorkerSpec.from_json(spec.to_json()).engine  # as the scheduler process reads it
        assert (engine.page_size, engine.ttft_slo_ms, engine.enable_prefix_caching) == (32, 250, False)
        assert engine == msgspec.structs.replace(config.engine, device=engine.device,
                                                 served_model_name=engine.served_model_name)  # fmt: skip


def test_flags_override_env_which_overrides_the_file(tmp_path):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text("max_num_seqs = 4\nenable_chunked_prefill = true\ninteractive_ttft_target = 1.0\n")
    env = {"TOKEND_MAX_NUM_SEQS": "8", "TOKEND_ENABLE_CHUNKED_PREFILL": "off", "TOKEND_INTERACTIVE_TTFT_TARGET": "3"}
    base = ("--config", str(config_file))
    assert _load(*base).engine.max_num_seqs == 4
    config = _load(*base, environ=env)
    assert (config.engine.max_num_seqs, config.engine.enable_chunked_prefill) == (8, False)
    assert config.admission.interactive_ttft_target == 3.0
    flags = ("--max-num-seqs", "16", "--enable-chunked-prefill", "--interactive-ttft-target", "0.5")
    config = _load(*base, *flags, environ=env)
    assert (config.engine.max_num_seqs, config.engine.enable_chunked_prefill) == (16, True)
    assert config.admission.interactive_ttft_target == 0.5


def test_env_sets_daemon_options_too_and_ignores_empty_or_unknown_variables(tmp_path):
    env = {"TOKEND_GRPC_PORT": "6001", "TOKEND_LOG_LEVEL": "debug", "TOKEND_MAX_MODEL_LEN": "", "TOKEND_NOPE": "1"}
    config = _load(environ=env)
    assert (config.grpc_port, config.log_level, config.engine.max_model_len) == (6001, "debug", None)


@pytest.mark.parametrize(
    ("name", "value", "key"),
    [
        ("TOKEND_MAX_NUM_SEQS", "eight", "max_num_seqs"),
        ("TOKEND_ENABLE_PREFIX_CACHING", "maybe", "enable_prefix_caching"),
        ("TOKEND_DTYPE", "float64", "dtype"),
        ("TOKEND_GPU_MEMORY_UTILIZATION", "2", "gpu_memory_utilization"),
        ("TOKEND_MAX_QUEUED_REQUESTS", "0", "max_queued_requests"),
    ],
)
def test_a_bad_env_value_is_named(name, value, key):
    with pytest.raises(ValueError, match=f"^{key}"):
        _load(environ={name: value})


def test_a_bad_flag_value_exits_78_naming_the_key():
    result = _cli("serve", "--page-size", "12", "--state-dir", "/nonexistent/tokend")
    assert result.returncode == 78 and "page_size" in result.stderr


@pytest.mark.parametrize("debug", ["1", "0"])
def test_tokend_debug_in_the_daemons_env_reaches_the_scheduler(monkeypatch, tmp_path, debug):
    monkeypatch.setenv("TOKEND_DEBUG", debug)
    (spec,) = scheduler_specs(_load(), tmp_path)
    assert WorkerSpec.from_json(spec.to_json()).engine.debug_checks is (debug == "1")


def test_each_scheduler_gets_its_models_identity_and_the_shared_options(tmp_path, llama_dir):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text(
        f'max_num_seqs = 4\n[[models]]\nname = "a"\ngroups = ["cpu", "cpu"]\n\n'
        f'[[models]]\nname = "b"\npath = "{llama_dir}"\ngroups = ["cpu"]\n'
    )
    specs = scheduler_specs(_load("--config", str(config_file)), tmp_path)
    identities = [(s.worker_id, s.engine.served_model_name, s.engine.model, s.engine.device) for s in specs]
    assert identities == [("a/0", "a", None, "cpu"), ("a/1", "a", None, "cpu"), ("b/0", "b", str(llama_dir), "cpu")]
    assert {s.engine.max_num_seqs for s in specs} == {4}


def test_admission_options_reach_the_frontend_as_given(tmp_path):
    config_file = tmp_path / "tokend.toml"
    config_file.write_text("batch_max_queue_wait = 12.5\nmax_queued_requests = 7\n")
    config = _load("--config", str(config_file), "--batch-ttft-target", "9")
    spec = FrontendSpec.from_json(frontend_spec(config, tmp_path, scheduler_specs(config, tmp_path)).to_json())
    expected = AdmissionSpec(batch_max_queue_wait=12.5, max_queued_requests=7, batch_ttft_target=9.0)
    assert spec.admission == config.admission == expected
    default = DEFAULT_MODEL_NAME  # no model named: the default
    assert [(s.worker_id, s.model_name) for s in spec.schedulers] == [(f"{default}/0", default)]
