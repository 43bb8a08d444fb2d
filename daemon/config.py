"""ServeConfig: every option of `tokend serve`, from flags over a TOML file over defaults, validated.

Each option is a flag (`--max-num-seqs`) and the same key in the TOML file (`max_num_seqs`); an error names it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from frontend.spec import TenantSpec

DEFAULT_MODEL_NAME = "tokend-tiny-random"  # gpu_runtime.default_model's; repeated to keep torch out of here


def _default_state_dir() -> str:
    # systemd's StateDirectory= sets $STATE_DIRECTORY; elsewhere the XDG place.
    if "STATE_DIRECTORY" in os.environ:
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    return str(Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "tokend")


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One served model: a `[[models]]` table of the TOML file."""

    name: str  # what clients put in `model`
    path: str | None = None  # a Hugging Face directory; unset: the embedded default model
    aliases: list[str] = []  # other names that reach it
    groups: list[str] = []  # devices, one scheduler each; empty: those of `device`


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: tuple[str, ...] = ()  # Hugging Face directories; empty serves the embedded default model
    served_model_name: str | None = None  # the name clients use (one model only); default: the directory's name
    grpc_port: int = 50051  # the frontend listens on 127.0.0.1 only
    metrics_port: int = 9401  # Prometheus text on http://127.0.0.1:<port>/metrics; 0 turns it off
    http_port: int = 8000  # the OpenAI-compatible HTTP/SSE gateway on 127.0.0.1; 0 turns it off
    state_dir: str = field(default_factory=_default_state_dir)
    device: str = "auto"  # one scheduler per entry of a comma-separated list, e.g. "cuda:0,cuda:1"
    dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    kv_cache_bytes: int | None = None  # None: 512 MiB on CPU, 90% of free memory on a GPU
    max_model_len: int | None = None
    scheduling: str = "continuous"
    # torch threads per scheduler process; 0: the cores left after one for the frontend and gateway, shared
    # among the schedulers (threads that outnumber free cores wait on each other at every parallel op)
    cpu_threads: int = 0
    drain_timeout: float = 30.0  # seconds in-flight streams get to finish on SIGTERM
    stall_timeout: float = 120.0  # a scheduler loop stuck this long is killed and restarted
    log_level: str = "info"
    interactive_ttft_target: float = 2.0  # seconds; beyond it, queued batch work is shed to make way
    batch_ttft_target: float = 30.0  # seconds; beyond it, batch work waits (up to batch_max_queue_wait) or is shed
    batch_max_queue_wait: float = 60.0  # a batch request waiting this long for a slot is shed
    max_queued_requests: int = 256  # waiting for a slot, both classes; when full, the newest batch request is shed
    models: tuple[ModelSpec, ...] = ()  # [[models]] tables: several models, each with its name, aliases, groups
    tenants: tuple[TenantSpec, ...] = ()  # [[tenants]] tables in the TOML file; none: authentication is off

    def __post_init__(self) -> None:
        for key in ("grpc_port", "metrics_port", "http_port"):
            value = getattr(self, key)
            low = 1 if key == "grpc_port" else 0
            _check(key, _is_int(value) and low <= value <= 65535, f"an integer in [{low}, 65535]", value)
        _check("model", all(isinstance(m, str) and m for m in self.model), "paths to model directories", self.model)
        for path in self.model:
            _check("model", Path(path, "config.json").is_file(), "a directory with a config.json", path)
        _check(
            "served_model_name",
            self.served_model_name is None or (self.served_model_name and len(self.model) <= 1),
            "a non-empty name, given for a single model",
            self.served_model_name,
        )
        _check("device", all(self.devices), "a comma-separated list of devices (auto, cpu, cuda, cuda:N)", self.device)
        _check(
            "dtype",
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            "auto|float32|bfloat16|float16",
            self.dtype,
        )
        _check("cpu_threads", _is_int(self.cpu_threads) and self.cpu_threads >= 0, "an integer >= 0 (0 = auto)",
               self.cpu_threads)  # fmt: skip
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            _check(key, _is_int(getattr(self, key)) and getattr(self, key) >= 1, "an integer >= 1", getattr(self, key))
        _check(
            "kv_cache_bytes",
            self.kv_cache_bytes is None or (_is_int(self.kv_cache_bytes) and self.kv_cache_bytes > 0),
            "a positive integer",
            self.kv_cache_bytes,
        )
        _check(
            "max_model_len",
            self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len >= 2),
            "an integer >= 2",
            self.max_model_len,
        )
        _check("scheduling", self.scheduling in ("continuous", "static"), "continuous|static", self.scheduling)
        _check("max_queued_requests", _is_int(self.max_queued_requests) and self.max_queued_requests >= 1,
               "an integer >= 1", self.max_queued_requests)  # fmt: skip
        for key in ("drain_timeout", "stall_timeout", "interactive_ttft_target", "batch_ttft_target",
                    "batch_max_queue_wait"):  # fmt: skip
            value = getattr(self, key)
            _check(
                key,
                isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0,
                "seconds >= 0",
                value,
            )
        _check_tenants(self.tenants)
        _check_models(self.models, bool(self.model))
        _check(
            "log_level",
            self.log_level in ("debug", "info", "warning", "error"),
            "debug|info|warning|error",
            self.log_level,
        )

    def served_models(self) -> list[ModelSpec]:
        """Every model to serve, the default first: [[models]], else --model paths, else the embedded model."""
        if self.models:
            return list(self.models)
        if self.model:
            return [ModelSpec(self.served_model_name or Path(path).name, path) for path in self.model]
        return [ModelSpec(DEFAULT_MODEL_NAME)]

    @property
    def devices(self) -> list[str]:
        return [d.strip() for d in self.device.split(",")] if isinstance(self.device, str) else []

    def scheduler_threads(self, num_schedulers: int) -> int:
        """torch threads for each scheduler process: `cpu_threads`, or else the cores this process may run on,
        less one for the frontend and the gateway, shared among the schedulers (at least one each)."""
        if self.cpu_threads:
            return self.cpu_threads
        cores = len(os.sched_getaffinity(0))
        return max(1, (cores - 1) // max(1, num_schedulers))

    def engine_options(self) -> dict[str, object]:
        """The EngineConfig fields this config sets."""
        options: dict[str, object] = {
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "scheduling": self.scheduling,
        }
        if self.kv_cache_bytes is not None:
            options["kv_cache_bytes"] = self.kv_cache_bytes
        if self.max_model_len is not None:
            options["max_model_len"] = self.max_model_len
        return options


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field; unset flags stay None so that the TOML file and defaults show through."""
    parser.add_argument("--config", type=Path, help="a TOML file with the same keys as the flags")
    parser.add_argument("--model", action="append", help="Hugging Face model directory (default: embedded model)")
    parser.add_argument("--served-model-name")
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--metrics-port", type=int, help="0 turns /metrics off")
    parser.add_argument("--http-port", type=int, help="the HTTP/SSE gateway's port; 0 turns the gateway off")
    parser.add_argument("--state-dir")
    parser.add_argument("--device", help="auto, cpu, cuda, cuda:N; a comma-separated list runs one scheduler each")
    parser.add_argument("--dtype")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--kv-cache-bytes", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--scheduling", choices=["continuous", "static"])
    parser.add_argument("--cpu-threads", type=int, help="torch threads per scheduler; 0: the cores left, shared")
    parser.add_argument("--drain-timeout", type=float, help="seconds in-flight streams get on SIGTERM")
    parser.add_argument("--stall-timeout", type=float, help="seconds before a stuck scheduler is restarted")
    parser.add_argument("--log-level")
    parser.add_argument("--interactive-ttft-target", type=float, help="seconds; interactive's first-token target")
    parser.add_argument("--batch-ttft-target", type=float, help="seconds; batch's first-token target")
    parser.add_argument("--batch-max-queue-wait", type=float, help="seconds a batch request may wait for a slot")
    parser.add_argument("--max-queued-requests", type=int, help="requests that may wait for a slot")


def load_serve_config(args: argparse.Namespace) -> ServeConfig:
    """Defaults, then the TOML file, then the flags; raises ValueError naming the bad key."""
    values: dict[str, object] = {}
    if args.config is not None:
        values.update(_read_toml(args.config))
    for f in dataclasses.fields(ServeConfig):
        flag_value = getattr(args, f.name, None)
        if flag_value is not None:
            values[f.name] = flag_value
    if isinstance(values.get("model"), str):
        values["model"] = [values["model"]]
    if "tenants" in values:
        values["tenants"] = _tables(values["tenants"], TenantSpec, "tenants")
    if "models" in values:
        values["models"] = _tables(values["models"], ModelSpec, "models")
    if "model" in values:
        _check("model", isinstance(values["model"], list), "a path or a list of paths", values["model"])
        values["model"] = tuple(values["model"])
    return ServeConfig(**values)


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as error:
        raise ValueError(f"config: cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"config: {path} is not valid TOML: {error}") from None
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key in {path}; known keys: {sorted(known)}")
    return data


def _tables(tables: object, spec_type: type, key: str) -> tuple:
    _check(key, isinstance(tables, list), f"a list of [[{key}]] tables", tables)
    specs = []
    for index, table in enumerate(tables):
        try:
            specs.append(msgspec.convert(table, spec_type))
        except msgspec.ValidationError as error:
            raise ValueError(f"{key}[{index}]: {error}") from None
    return tuple(specs)


def _check_models(models: tuple[ModelSpec, ...], has_model_paths: bool) -> None:
    _check("models", not (models and has_model_paths), "given either as [[models]] or as model paths, not both", "both")
    names: set[str] = set()
    for index, model in enumerate(models):
        key = f"models[{index}]"
        for name in [model.name, *model.aliases]:
            _check(f"{key}.name", bool(name) and name not in names, "names and aliases unique and non-empty", name)
            names.add(name)
        if model.path is not None:
            _check(
                f"{key}.path", Path(model.path, "config.json").is_file(), "a directory with a config.json", model.path
            )
        _check(f"{key}.groups", all(model.groups), "a list of devices", model.groups)


def _check_tenants(tenants: tuple[TenantSpec, ...]) -> None:
    names, hashes = set(), set()
    for index, tenant in enumerate(tenants):
        key = f"tenants[{index}]"
        _check(f"{key}.name", bool(tenant.name) and tenant.name not in names, "a unique, non-empty name", tenant.name)
        digest = tenant.api_key_sha256
        _check(
            f"{key}.api_key_sha256",
            len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) and digest not in hashes,
            "the lowercase hex SHA-256 of the key (sha256sum prints it), unique",
            "<hidden>",
        )
        for name in ("priority", "max_priority"):
            value = getattr(tenant, name)
            _check(f"{key}.{name}", value in ("interactive", "batch"), "interactive|batch", value)
        _check(
            f"{key}.priority",
            not (tenant.priority == "interactive" and tenant.max_priority == "batch"),
            "no more urgent than max_priority",
            tenant.priority,
        )
        for name in ("max_concurrent", "tokens_per_minute"):
            value = getattr(tenant, name)
            _check(f"{key}.{name}", value >= 0, "an integer >= 0 (0 = unlimited)", value)
        names.add(tenant.name)
        hashes.add(digest)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(key: str, ok: bool, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{key}: must be {expected}, got {value!r}")
