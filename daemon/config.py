"""ServeConfig: every option of `tokend serve`, from flags over TOKEND_<KEY> variables over a TOML file over defaults.

Each option is declared once, as a field of ServeConfig (the daemon's own), EngineConfig (each scheduler's engine)
or AdmissionSpec (the frontend's admission); config_flags turns every field into a flag (`--max-num-seqs`), a TOML
key (`max_num_seqs`) and an environment variable (`TOKEND_MAX_NUM_SEQS`). All of it is validated, cross-field
rules included, before any process starts; an error names the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from common.addresses import is_loopback
from common.lanes import DrainAction, KVLoadFailure, KVTransport
from daemon import config_flags
from daemon.config_checks import check_no_roles_under_tp, rollout_roots
from daemon.gpu_placement import ModelShare, Placement, place, visible_gpus
from frontend.spec import AdmissionSpec, AutoscaleSpec, TenantSpec
from gpu_runtime.default_model import DEFAULT_MODEL_NAME, MODEL_REFERENCE, is_model_reference, served_name
from gpu_runtime.engine_config import TOOL_CALL_PARSERS, EngineConfig

_ENUM_FIELDS = {"on_drain_timeout": DrainAction, "kv_transfer_transport": KVTransport,
                "kv_load_failure": KVLoadFailure}  # fmt: skip


def default_state_dir() -> str:
    # systemd's StateDirectory= sets $STATE_DIRECTORY; elsewhere the XDG place.
    if "STATE_DIRECTORY" in os.environ:
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    return str(Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "tokend")


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One served model: a `[[models]]` table of the TOML file."""

    name: str  # what clients put in `model`
    path: str | None = None  # a checkpoint directory, a .gguf file or a built-in model's name; unset: the default
    aliases: list[str] = []  # other names that reach it
    groups: list[str] = []  # devices, one scheduler each ("cuda:0,cuda:1": one on both); empty: those of `device`
    # Its share of a GPU it shares with other schedulers; unset: the engine options' own.
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int | None = None
    tool_call_parser: str | None = None  # how `auto` tool calls are read from its text; unset: the engine options'


class ServeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The daemon's own options, and the engine's and admission's, each declared once in its own struct."""

    model: Annotated[
        tuple[str, ...],
        _doc(f"{MODEL_REFERENCE}; repeat it (a TOML list) to serve several; unset: {DEFAULT_MODEL_NAME}, the default"),
    ] = ()
    served_model_name: Annotated[str | None, _doc("the name clients use (one model); unset: the directory's")] = None
    host: Annotated[
        str,
        _doc("the address the gRPC, HTTP and metrics listeners bind; beyond loopback it needs [[tenants]] or "
             "--allow-unauthenticated"),
    ] = "127.0.0.1"  # fmt: skip
    allow_unauthenticated: Annotated[
        bool, _doc("serve a non-loopback --host with no [[tenants]]: anyone who reaches it may use it")
    ] = False
    grpc_port: Annotated[int, _doc("the frontend's gRPC port, on --host")] = 50051
    metrics_port: Annotated[int, _doc("Prometheus text on http://<host>:<port>/metrics; 0 turns it off")] = 9401
    http_port: Annotated[int, _doc("the OpenAI-compatible HTTP/SSE gateway on --host; 0 turns it off")] = 8000
    http_header_timeout: Annotated[
        float, _doc("seconds an HTTP client has to send a request's headers (slowloris guard)")
    ] = 10.0
    http_max_connections: Annotated[int, _doc("open HTTP connections at once; one more gets a 503")] = 1024
    tenants_file: Annotated[
        str,
        _doc("a TOML file of [[tenants]] tables kept apart from the config (a Kubernetes Secret, a 0600 file), "
             "added to the config's own"),
    ] = ""  # fmt: skip
    tenant_metrics: Annotated[
        bool, _doc("per-tenant series (tenant names and their usage) on /metrics; off: the ledger alone has them")
    ] = False
    metrics_token_sha256: Annotated[
        str, _doc('hex SHA-256 of a bearer token that /metrics then requires (`printf %s "$TOKEN" | sha256sum`)')
    ] = ""
    state_dir: Annotated[
        str, _doc("persistent state (the usage ledger); $STATE_DIRECTORY under systemd, else $XDG_STATE_HOME/tokend")
    ] = msgspec.field(default_factory=default_state_dir)
    device: Annotated[
        str,
        _doc(
            "auto (one scheduler per visible GPU, else one on the CPU), cpu, cpu@N or cpu@N-M (bound to those "
            "cores, a torch thread each), cuda, cuda:N; a list (cuda:0,cuda:1) runs one scheduler each, each seeing "
            "only its GPU (CUDA_VISIBLE_DEVICES)"
        ),
    ] = "auto"
    # Threads that outnumber free cores wait on each other at every parallel op, hence the sharing.
    cpu_threads: Annotated[
        int,
        _doc("torch threads per scheduler; 0: a pinned group's cores (cpu@0-3), else the cores left after one for "
             "the frontend and gateway, shared"),
    ] = 0  # fmt: skip
    drain_timeout: Annotated[float, _doc("seconds in-flight streams get to finish on SIGTERM")] = 30.0
    spare_devices: Annotated[
        str,
        _doc("devices no model starts on, kept for surge rollouts: a list like --device's (cpu,cpu: two CPU "
             "groups; cuda:2,cuda:3); empty: rollouts restart groups in place"),
    ] = ""  # fmt: skip
    rollout_drain_timeout: Annotated[
        float, _doc("seconds an old worker's streams get to finish during a rollout before on_drain_timeout")
    ] = 600.0
    on_drain_timeout: Annotated[
        DrainAction,
        _doc("at the rollout drain timeout: abort (the stream ends with finish_reason abort) or migrate (its prompt "
             "and tokens so far go on on a new worker)"),
    ] = DrainAction.ABORT  # fmt: skip
    stall_timeout: Annotated[float, _doc("seconds before a stuck scheduler loop is killed and restarted")] = 30.0
    worker_start_timeout: Annotated[
        float,
        _doc("seconds a new worker has to load its model and reach its loop; past it, it is killed and counted as a "
             "failed start (a model file that makes a loader spin cannot hold its group for ever)"),
    ] = 600.0  # fmt: skip
    model_roots: Annotated[
        tuple[str, ...],
        _doc("absolute directories a rollout's path must lie in, once symlinks are resolved; repeat it (a TOML list) "
             "for several; unset: the directories holding the configured models, and the model cache"),
    ] = ()  # fmt: skip
    disagg_min_prompt_tokens: Annotated[
        int,
        _doc("with prefill and decode pools (groups like cpu=prefill, cuda:1=decode): prompts shorter than this "
             "go straight to a decode worker"),
    ] = 64  # fmt: skip
    prefix_routing_weight: Annotated[
        float,
        _doc("prefix-aware routing: a request goes to the worker where its projected wait plus this weight times the "
             "prefill of its prompt tokens not cached there is least (from the workers' KV events); 0: by the wait "
             "alone (least loaded)"),
    ] = 1.0  # fmt: skip
    enable_kv_cache_events: Annotated[
        bool,
        _doc("publish the box's KV cache events (pages stored and removed, with their tokens) in vLLM's wire format "
             "for routers outside it (llm-d, Dynamo): a ZeroMQ PUB socket at --kv-events-endpoint and a replay "
             "socket at --kv-events-replay-endpoint"),
    ] = False  # fmt: skip
    kv_events_endpoint: Annotated[
        str, _doc("where the KV events' PUB socket binds (tcp:// or ipc://); the events carry prompt tokens")
    ] = "tcp://127.0.0.1:5557"
    kv_events_replay_endpoint: Annotated[
        str, _doc("where the ROUTER socket answering replay requests binds; empty: none")
    ] = "tcp://127.0.0.1:5558"
    kv_events_topic: Annotated[str, _doc("the topic of the KV events' messages ({model} becomes the model's name)")] = (
        ""
    )
    kv_lease_seconds: Annotated[
        float, _doc("seconds a prefill worker keeps a prompt's KV pages for a decode worker that has not pulled them")
    ] = 30.0
    kv_transfer_transport: Annotated[
        KVTransport,
        _doc("how a decode worker pulls KV pages from a prefill worker: zmq (frames over the private ipc socket; "
             "always works) or nixl (a UCX READ out of the prefill worker's registered pool; needs the nixl "
             "package)"),
    ] = KVTransport.ZMQ  # fmt: skip
    kv_load_failure: Annotated[
        KVLoadFailure,
        _doc("when a decode worker cannot pull a prompt's pages: recompute the prompt there, or fail the request "
             "(UNAVAILABLE, retryable)"),
    ] = KVLoadFailure.RECOMPUTE  # fmt: skip
    # Its running requests wait on (the scheduler may resume) until stall_timeout kills it.
    liveness_timeout: Annotated[
        float,
        _doc(
            "seconds without a word from a scheduler (load reports between steps, keep-alives during a long one) "
            "before it gets no new requests and health says NOT_SERVING"
        ),
    ] = 2.0
    log_level: Annotated[
        Literal["debug", "info", "warning", "error"], _doc("JSON log lines on stderr at this level and above")
    ] = "info"
    models: tuple[ModelSpec, ...] = ()  # [[models]] tables (TOML only): several models, with names, aliases, groups
    tenants: tuple[TenantSpec, ...] = ()  # [[tenants]] tables (TOML only); none: authentication is off
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)  # model, served_model_name, device: unset
    admission: AdmissionSpec = msgspec.field(default_factory=AdmissionSpec)
    autoscale: AutoscaleSpec = msgspec.field(default_factory=AutoscaleSpec)

    def __post_init__(self) -> None:
        for key in ("grpc_port", "metrics_port", "http_port"):
            value = getattr(self, key)
            low = 1 if key == "grpc_port" else 0
            _check(key, _is_int(value) and low <= value <= 65535, f"an integer in [{low}, 65535]", value)
        _check("model", all(isinstance(m, str) and m for m in self.model), "paths to model directories", self.model)
        for path in self.model:
            _check("model", is_model_reference(path), MODEL_REFERENCE, path)
        _check(
            "served_model_name",
            self.served_model_name is None or (self.served_model_name and len(self.model) <= 1),
            "a non-empty name, given for a single model",
            self.served_model_name,
        )
        _check("state_dir", isinstance(self.state_dir, str) and bool(self.state_dir), "a directory", self.state_dir)
        _check("device", all(self.devices), "a comma-separated list of devices (auto, cpu, cuda, cuda:N)", self.device)
        _check("cpu_threads", _is_int(self.cpu_threads) and self.cpu_threads >= 0, "an integer >= 0 (0 = auto)",
               self.cpu_threads)  # fmt: skip
        _check("http_max_connections", _is_int(self.http_max_connections) and self.http_max_connections >= 1,
               "an integer >= 1", self.http_max_connections)  # fmt: skip
        for key in ("drain_timeout", "stall_timeout", "rollout_drain_timeout"):
            value = getattr(self, key)
            _check(key, _is_number(value) and value >= 0, "seconds >= 0", value)
        _check("disagg_min_prompt_tokens", _is_int(self.disagg_min_prompt_tokens) and self.disagg_min_prompt_tokens
               >= 0, "an integer >= 0", self.disagg_min_prompt_tokens)  # fmt: skip
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, key)
            _check(key, isinstance(endpoint, str) and (endpoint.startswith(("tcp://", "ipc://")) or
                                                       (key == "kv_events_replay_endpoint" and not endpoint)),
                   "a tcp:// or ipc:// address", endpoint)  # fmt: skip
        weight = self.prefix_routing_weight
        _check("prefix_routing_weight", _is_number(weight) and 0 <= weight < math.inf, "a finite number >= 0", weight)
        self._take_enums()
        nixl_found = importlib.util.find_spec("nixl") is not None
        _check("kv_transfer_transport", self.kv_transfer_transport != KVTransport.NIXL or nixl_found,
               "zmq, or nixl with the nixl package installed (pip install nixl-cu12 nixl)",
               str(self.kv_transfer_transport))  # fmt: skip
        _check("model_roots", all(isinstance(r, str) and os.path.isabs(r) for r in self.model_roots),
               "absolute directories", self.model_roots)  # fmt: skip
        for key in ("liveness_timeout", "http_header_timeout", "kv_lease_seconds", "worker_start_timeout"):
            value = getattr(self, key)
            _check(key, _is_number(value) and value > 0, "seconds > 0", value)
        _check(
            "metrics_token_sha256",
            self.metrics_token_sha256 == "" or _is_sha256_hex(self.metrics_token_sha256),
            "the lowercase hex SHA-256 of the token (sha256sum prints it)",
            "<hidden>",
        )
        _check_tenants(self.tenants)
        self._check_exposure()
        _check_models(self.models, bool(self.model))
        _check(
            "log_level",
            self.log_level in ("debug", "info", "warning", "error"),
            "debug|info|warning|error",
            self.log_level,
        )

    def _take_enums(self) -> None:
        """A TOML file's text for an enum field becomes its member (flags and variables were checked already), so
        that a bad value is refused naming the key, as a flag's is."""
        for key in _ENUM_FIELDS:
            kind, value = _ENUM_FIELDS[key], getattr(self, key)
            _check(key, value in set(kind), "one of " + "|".join(kind), value)
            msgspec.structs.force_setattr(self, key, kind(value))

    def _check_exposure(self) -> None:
        """An inference port open beyond this machine with no keys is how clusters get abused: only on request."""
        _check("host", isinstance(self.host, str) and bool(self.host.strip()), "an address to listen on", self.host)
        if is_loopback(self.host):
            return
        if not self.tenants and not self.allow_unauthenticated:
            raise ValueError(
                f"host: {self.host!r} reaches beyond this machine and no [[tenants]] are configured, so anyone who "
                "can reach it could use the models; configure tenants, or pass --allow-unauthenticated "
                "(allow_unauthenticated = true) to serve it open on purpose"
            )
        _check(
            "tenant_metrics",
            not self.tenant_metrics or bool(self.metrics_token_sha256),
            "off, or guarded by metrics_token_sha256, when --host reaches beyond loopback",
            self.tenant_metrics,
        )

    @property
    def metrics_need_token(self) -> bool:
        """Whether the API port's /metrics needs metrics_token_sha256: beyond loopback with tenants, the series
        (models, load, tenants' usage) are not for whoever reaches the API. Checked when scraped, not at start: a
        scrape without the token is refused naming the key, inference still serves. The metrics port is the
        operator's scrape port and is left to its own token (an in-cluster EPP scrapes it without one)."""
        return bool(self.tenants) and not is_loopback(self.host)

    def local_address(self, port: int) -> str:
        """host:port where this machine's own processes reach a listener (a wildcard bind through loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def served_models(self) -> list[ModelSpec]:
        """Every model to serve, the default first: [[models]], else --model paths, else the embedded model."""
        if self.models:
            return list(self.models)
        if self.model:
            return [ModelSpec(self.served_model_name or served_name(path), path) for path in self.model]
        return [ModelSpec(DEFAULT_MODEL_NAME)]

    def scheduler_placements(self, environ: Mapping[str, str] = os.environ) -> list[Placement]:
        """One per scheduler process: each served model on each of its groups (`auto`: one per visible GPU), with
        the CUDA_VISIBLE_DEVICES it gets. ValueError names the key of a missing or over-shared GPU."""
        served = self.served_models()
        engines = [self.engine_of(model) for model in served]
        shares = [ModelShare(engine.gpu_memory_utilization, engine.kv_cache_bytes) for engine in engines]
        models = [(model.name, list(model.groups)) for model in served]
        placements = place(models, self.devices, shares, visible_gpus(environ))
        for placement in placements:
            _check_ranks_fit(placement, engines[placement.model_index].tensor_parallel_size)
            check_no_roles_under_tp(placement, engines[placement.model_index].tensor_parallel_size)
        return placements

    def engine_of(self, model: ModelSpec) -> EngineConfig:
        """The engine options of a model's schedulers: the shared ones, with its identity and its own share of a
        GPU (device: each scheduler's own)."""
        share = {"gpu_memory_utilization": model.gpu_memory_utilization, "kv_cache_bytes": model.kv_cache_bytes,
                 "tool_call_parser": model.tool_call_parser}  # fmt: skip
        own = {key: value for key, value in share.items() if value is not None}
        return msgspec.structs.replace(self.engine, model=model.path, served_model_name=model.name, **own)

    @property
    def devices(self) -> list[str]:
        return [d.strip() for d in self.device.split(",")] if isinstance(self.device, str) else []

    def spare_placements(self, environ: Mapping[str, str] = os.environ) -> list[Placement]:
        """One per spare device (spare_devices): where surge rollouts start new workers. ValueError names the key."""
        spares = [d.strip() for d in self.spare_devices.split(",") if d.strip()]
        placements = place([("", spares)], [], [], visible_gpus(environ)) if spares else []
        tensor_parallel_size = max(self.engine_of(model).tensor_parallel_size for model in self.served_models())
        for placement in placements:  # any model may start a worker on a spare
            check_no_roles_under_tp(dataclasses.replace(placement, key="spare_devices"), tensor_parallel_size)
        return placements

    def rollout_roots(self) -> list[str]:
        """Where a rollout's weights may come from (model_roots), each resolved (daemon.config_checks)."""
        return rollout_roots(self.model_roots, [model.path for model in self.served_models()])

    def scheduler_threads(self, num_schedulers: int, pinned_cores: tuple[int, ...] = ()) -> int:
        """torch threads for each scheduler process: `cpu_threads`; else one per core of a pinned group; else the
        cores this process may run on, less one for the frontend and the gateway, shared among the schedulers (at
        least one each)."""
        if self.cpu_threads:
            return self.cpu_threads
        if pinned_cores:
            return len(pinned_cores)
        cores = len(os.sched_getaffinity(0))
        return max(1, (cores - 1) // max(1, num_schedulers))


def _check_ranks_fit(placement: Placement, tensor_parallel_size: int) -> None:
    """Under tensor parallelism on CUDA each rank takes one GPU of its group: the group must have that many."""
    if tensor_parallel_size == 1 or placement.cuda_visible_devices is None:
        return
    gpus = len(placement.cuda_visible_devices.split(","))
    if gpus != tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size: {tensor_parallel_size} ranks need a group of {tensor_parallel_size} GPUs, one "
            f"each, but {placement.key} gives {placement.model_name} the group {placement.label!r} of {gpus}; "
            f'list them together (groups = ["cuda:0,cuda:1"]) or set tensor_parallel_size = {gpus}'
        )


# Each scheduler's identity (which model, which device) comes from the daemon's own model/device options, and
# debug_checks from TOKEND_DEBUG: none of them is an engine flag.
_ENGINE_IDENTITY = frozenset({"model", "served_model_name", "device", "debug_checks"})
DAEMON_OPTIONS = config_flags.options_of(
    ServeConfig, skip=frozenset({"models", "tenants", "engine", "admission", "autoscale"})
)
ENGINE_OPTIONS = config_flags.options_of(EngineConfig, skip=_ENGINE_IDENTITY)
ADMISSION_OPTIONS = config_flags.options_of(AdmissionSpec)
AUTOSCALE_OPTIONS = config_flags.options_of(AutoscaleSpec)
ALL_OPTIONS = [*DAEMON_OPTIONS, *ENGINE_OPTIONS, *ADMISSION_OPTIONS, *AUTOSCALE_OPTIONS]
TOML_KEYS = frozenset({o.key for o in ALL_OPTIONS} | {"models", "tenants"})


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """`tokend serve`'s flags: --config, then one per option, grouped by the process they configure."""
    parser.add_argument("--config", type=Path, help="a TOML file whose top-level keys are the flags' names in "
                        "snake_case, plus [[models]] and [[tenants]] tables (default: none)")  # fmt: skip
    config_flags.add_flags(parser.add_argument_group("daemon"), DAEMON_OPTIONS)
    config_flags.add_flags(parser.add_argument_group("engine (each scheduler process)"), ENGINE_OPTIONS)
    config_flags.add_flags(parser.add_argument_group("admission (the frontend)"), ADMISSION_OPTIONS)
    config_flags.add_flags(parser.add_argument_group("autoscaler (the frontend decides, the daemon acts)"),
                           AUTOSCALE_OPTIONS)  # fmt: skip


def load_serve_config(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> ServeConfig:
    """Defaults, then the TOML file, then TOKEND_<KEY> variables, then the flags; every check, cross-field ones
    included, runs here. Raises ValueError naming the bad key."""
    values: dict[str, object] = {}
    if getattr(args, "config", None) is not None:
        values.update(_read_config_file(args.config))
    values.update(config_flags.from_env(ALL_OPTIONS, environ))
    values.update(config_flags.from_flags(ALL_OPTIONS, args))
    for key in ("model", "model_roots"):  # a TOML string or list, a flag repeated
        if isinstance(values.get(key), str):
            values[key] = [values[key]]
        if key in values:
            _check(key, isinstance(values[key], list), "a path or a list of paths", values[key])
            values[key] = tuple(values[key])
    if values.get("tenants_file"):
        values["tenants"] = [*values.get("tenants", []), *_read_tenants_file(Path(str(values["tenants_file"])))]
    for key, spec_type in (("tenants", TenantSpec), ("models", ModelSpec)):
        if key in values:
            values[key] = _tables(values[key], spec_type, key)
    engine = EngineConfig(**_take(values, ENGINE_OPTIONS))
    admission = AdmissionSpec(**_take(values, ADMISSION_OPTIONS))
    autoscale = AutoscaleSpec(**_take(values, AUTOSCALE_OPTIONS))
    config = ServeConfig(**values, engine=engine, admission=admission, autoscale=autoscale)
    # Against the GPUs this environment shows: a device that is not there, or one GPU shared without shares.
    config.scheduler_placements(environ)
    config.spare_placements(environ)
    return config


def _take(values: dict[str, object], options: list[config_flags.Option]) -> dict[str, object]:
    return {o.key: values.pop(o.key) for o in options if o.key in values}


def _read_toml(path: Path, key: str = "config") -> dict[str, object]:
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ValueError(f"{key}: cannot read {path}: {error.strerror}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{key}: {path} is not valid TOML: {error}") from None


def _read_config_file(path: Path) -> dict[str, object]:
    data = _read_toml(path)
    unknown = sorted(set(data) - TOML_KEYS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key in {path}; known keys: {sorted(TOML_KEYS)}")
    return data


def _read_tenants_file(path: Path) -> list[object]:
    data = _read_toml(path, "tenants_file")
    unknown = sorted(set(data) - {"tenants"})
    if unknown:
        raise ValueError(f"tenants_file: {path} may hold only [[tenants]] tables, not {unknown[0]!r}")
    tenants = data.get("tenants", [])
    _check("tenants_file", isinstance(tenants, list), "[[tenants]] tables", tenants)
    return tenants


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
            _check(f"{key}.path", is_model_reference(model.path), MODEL_REFERENCE, model.path)
        _check(f"{key}.groups", all(model.groups), "a list of devices", model.groups)
        share = model.gpu_memory_utilization
        _check(f"{key}.gpu_memory_utilization", share is None or (_is_number(share) and 0 < share <= 1), "in (0, 1]",
               share)  # fmt: skip
        budget = model.kv_cache_bytes
        _check(f"{key}.kv_cache_bytes", budget is None or (_is_int(budget) and budget > 0), "a positive integer",
               budget)  # fmt: skip
        parser = model.tool_call_parser
        _check(f"{key}.tool_call_parser", parser is None or parser in TOOL_CALL_PARSERS, "|".join(TOOL_CALL_PARSERS),
               parser)  # fmt: skip


def _check_tenants(tenants: tuple[TenantSpec, ...]) -> None:
    names, hashes = set(), set()
    for index, tenant in enumerate(tenants):
        key = f"tenants[{index}]"
        _check(f"{key}.name", bool(tenant.name) and tenant.name not in names, "a unique, non-empty name", tenant.name)
        digest = tenant.api_key_sha256
        _check(
            f"{key}.api_key_sha256",
            _is_sha256_hex(digest) and digest not in hashes,
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


def _is_sha256_hex(value: str) -> bool:
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(key: str, ok: bool, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{key}: must be {expected}, got {value!r}")
