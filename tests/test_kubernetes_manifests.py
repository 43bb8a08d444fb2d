"""deploy/kubernetes/: every overlay renders with `kubectl kustomize`, every object is one the Kubernetes API accepts,
and what a user relies on holds: the config in the ConfigMap is a valid tokend config once mounted, the probes speak
gRPC health on tokend's port, the grace period outlasts the drain, the Secret and volumes sit where the config points.

How objects are validated (the API's models; closed subsets of the CRDs' schemas): tests/kubernetes_schemas.py.
"""

from __future__ import annotations

import base64
import functools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import pytest
import yaml
from kubernetes_schemas import api_errors, crd_errors, is_core

from daemon.cli import build_parser
from daemon.config import ServeConfig, load_serve_config
from frontend.lifecycle import LIVENESS_SERVICE

ROOT = Path(__file__).resolve().parent.parent
KUSTOMIZE_ROOT = ROOT / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(
    KUBECTL is None,
    reason="kubectl is not installed (its built-in kustomize renders the manifests): apt-get install kubectl",
)

# What each variant is made of: an overlay directory, or one composed here of an overlay and components.
VARIANTS = {
    "base": ("base", ()),
    "cpu": ("overlays/cpu", ()),
    "gpu": ("overlays/gpu", ()),
    "gpu-inference-pool": ("overlays/gpu-inference-pool", ()),
    "cpu+models-hostpath": ("overlays/cpu", ("components/models-hostpath",)),
    "gpu-keda": ("overlays/gpu-keda", ()),
    "gpu-hpa": ("overlays/gpu-hpa", ()),
}
IMAGE_UID = 10001  # the Dockerfile's `tokend` user (checked against its USER below)
STARTUP_WINDOW_S = 15 * 60  # loading and warming up a large model
# After drain_timeout the supervisor gives the frontend 10 s more, then the gateway and the schedulers 10 s each
# (daemon/supervisor.py, _shut_down): the most it takes beyond the drain before everything is reaped.
SHUTDOWN_AFTER_DRAIN_S = 30


# -- rendering ------------------------------------------------------------------------------------------------------


def _kustomize(directory: Path | str) -> list[dict]:
    result = subprocess.run(
        [KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@functools.cache
def rendered(variant: str) -> tuple[dict, ...]:
    directory, components = VARIANTS[variant]
    if not components:
        return tuple(_kustomize(KUSTOMIZE_ROOT / directory))
    with tempfile.TemporaryDirectory() as tmp:
        # kustomize takes no absolute paths, but relative ones may leave the kustomization's directory.
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(KUSTOMIZE_ROOT / directory, tmp)],
            "components": [os.path.relpath(KUSTOMIZE_ROOT / c, tmp) for c in components],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return tuple(_kustomize(tmp))


def find(objects: tuple[dict, ...], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: tuple[dict, ...], kind: str, name: str | None = None) -> dict:
    (found,) = find(objects, kind, name)
    return found


# -- what a pod is -------------------------------------------------------------------------------------------------


def workload(objects: tuple[dict, ...]) -> dict:
    """The tokend pods' controller: the base's Deployment, or per-pod-state's StatefulSet."""
    (found,) = find(objects, "Deployment", "tokend") + find(objects, "StatefulSet", "tokend")
    return found


def tokend_pod(objects: tuple[dict, ...]) -> tuple[dict, dict]:
    spec = workload(objects)["spec"]["template"]["spec"]
    (container,) = [c for c in spec["containers"] if c["name"] == "tokend"]
    return spec, container


def mount_at(pod: dict, container: dict, path: str) -> tuple[dict, dict | None]:
    """The volume mount that holds `path` (the deepest one), and its volume (None for a StatefulSet's claim
    template, which is no volume of the pod template)."""
    holding = [m for m in container.get("volumeMounts", []) if f"{path}/".startswith(f"{m['mountPath'].rstrip('/')}/")]
    assert holding, f"no volume is mounted at {path}"
    mount = max(holding, key=lambda m: len(m["mountPath"]))
    volumes = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert len(volumes) <= 1
    return mount, volumes[0] if volumes else None


def config_file(objects: tuple[dict, ...]) -> tuple[str, str]:
    """Where the container reads tokend.toml (--config) and the text the ConfigMap puts there."""
    pod, container = tokend_pod(objects)
    args = container["args"]
    path = args[args.index("--config") + 1]
    mount, volume = mount_at(pod, container, path)
    assert mount["mountPath"] == path and "subPath" in mount, "tokend.toml is mounted as one file"
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    return path, config_map["data"][mount["subPath"]]


def secret_file(objects: tuple[dict, ...], path: str) -> str:
    pod, container = tokend_pod(objects)
    mount, volume = mount_at(pod, container, path)
    assert "secret" in volume, f"{path} is not on a Secret"
    secret = one(objects, "Secret", volume["secret"]["secretName"])
    return base64.b64decode(secret["data"][os.path.relpath(path, mount["mountPath"])]).decode()


def image_environment() -> dict[str, str]:
    """The ENV of the Dockerfile's final stage: variables tokend reads (TOKEND_<KEY>) unless the pod overrides them."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    final_stage = lines[max(i for i, line in enumerate(lines) if line.upper().startswith("FROM ")) :]
    environment = {}
    for line in final_stage:
        if line.upper().startswith("ENV "):
            words = shlex.split(line[4:])
            if "=" not in words[0]:  # the old `ENV KEY value` form
                words = [f"{words[0]}={' '.join(words[1:])}"]
            environment.update(word.split("=", 1) for word in words)
    return environment


def service_link_environment(objects: tuple[dict, ...]) -> dict[str, str]:
    """The variables Kubernetes' service links would give the pod: docker-link style, per Service and port."""
    environment = {}
    for service in find(objects, "Service"):
        prefix = service["metadata"]["name"].upper().replace("-", "_")
        first = service["spec"]["ports"][0]
        environment[f"{prefix}_SERVICE_HOST"] = "10.0.0.1"
        environment[f"{prefix}_SERVICE_PORT"] = str(first["port"])
        environment[f"{prefix}_PORT"] = f"tcp://10.0.0.1:{first['port']}"
        for port in service["spec"]["ports"]:
            environment[f"{prefix}_PORT_{port['port']}_TCP"] = f"tcp://10.0.0.1:{port['port']}"
            environment[f"{prefix}_PORT_{port['port']}_TCP_PORT"] = str(port["port"])
    return environment


def pod_environment(objects: tuple[dict, ...]) -> dict[str, str]:
    """What tokend sees: the image's ENV, the container's env over it, and service links unless they are off."""
    pod, container = tokend_pod(objects)
    environment = image_environment()
    if pod.get("enableServiceLinks", True):
        environment.update(service_link_environment(objects))
    environment.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return environment


def loaded_config(objects: tuple[dict, ...], tmp_path: Path, environ: dict[str, str] | None = None) -> ServeConfig:
    """tokend's config as the pod would load it: the container's args, the ConfigMap's file, the Secret's tenants.
    The model directories do not exist here: they become empty checkpoint directories under tmp_path."""
    _, container = tokend_pod(objects)
    path, text = config_file(objects)
    values = tomllib.loads(text)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(secret_file(objects, values["tenants_file"]))
    copied = text.replace(values["tenants_file"], str(tenants))
    models = values.get("model", [])
    for model in [models] if isinstance(models, str) else models:
        stand_in = tmp_path / "models" / Path(model).name
        stand_in.mkdir(parents=True)
        (stand_in / "config.json").write_text("{}")
        copied = copied.replace(f'"{model}"', f'"{stand_in}"')
    (tmp_path / "tokend.toml").write_text(copied)
    args = [str(tmp_path / "tokend.toml") if arg == path else arg for arg in container["args"]]
    return load_serve_config(build_parser().parse_args(args), pod_environment(objects) if environ is None else environ)


# -- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_is_valid_for_the_api_or_its_crd(variant):
    objects = rendered(variant)
    assert objects, "nothing rendered"
    errors = [
        f"{o['kind']}/{o['metadata']['name']}: {e}"
        for o in objects
        for e in (api_errors(o) if is_core(o) else crd_errors(o))
    ]
    assert not errors, "\n".join(errors)
    for obj in objects:  # every object lands in the namespace, which the variant creates
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == one(objects, "Namespace")["metadata"]["name"], obj["metadata"]


def test_the_validation_refuses_what_the_api_server_would():
    deployment = one(rendered("cpu"), "Deployment", "tokend")

    def broken(change) -> dict:
        copy = yaml.safe_load(yaml.safe_dump(deployment))
        change(copy["spec"]["template"]["spec"]["containers"][0])
        return copy

    assert api_errors(broken(lambda c: c.update(imageName="x")))  # unknown field
    assert api_errors(broken(lambda c: c.update(image_pull_policy=c.pop("imagePullPolicy"))))  # Python name
    assert api_errors(broken(lambda c: c["ports"][0].update(containerPort="50051")))  # wrong type
    assert api_errors(broken(lambda c: c.pop("name")))  # missing required field
    assert api_errors({**deployment, "apiVersion": "apps/v2"})  # no such API
    pool = one(rendered("gpu-inference-pool"), "InferencePool")
    assert crd_errors({**pool, "spec": {**pool["spec"], "targetPort": 8000}})
    assert crd_errors({**pool, "spec": {**pool["spec"], "endpointPickerRef": {"name": "tokend-epp"}}})  # no port


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_configmap_is_a_valid_tokend_config_as_the_pod_loads_it(variant, tmp_path):
    objects = rendered(variant)
    config = loaded_config(objects, tmp_path)
    pod, container = tokend_pod(objects)
    assert container["args"][0] == "serve" and "command" not in container  # the image's entrypoint is `tokend`
    assert config.host == "0.0.0.0"
    assert config.tenants, "a non-loopback host needs tenants: tokend would refuse to start"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": config.grpc_port, "http": config.http_port, "metrics": config.metrics_port}
    state_mount = mount_at(pod, container, config.state_dir)[0]
    assert state_mount["mountPath"] == config.state_dir and not state_mount.get("readOnly")
    # One writer of each ledger: one pod on the shared claim, replaced with Recreate; or a claim per pod.
    controller = workload(objects)
    if controller["kind"] == "Deployment":
        claim = one(objects, "PersistentVolumeClaim", mount_at(pod, container, config.state_dir)[1]
                    ["persistentVolumeClaim"]["claimName"])["spec"]  # fmt: skip
        assert controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == "Recreate"
    else:
        assert mount_at(pod, container, config.state_dir)[1] is None  # the claim template's, one per pod
        (claim,) = [t["spec"] for t in controller["spec"]["volumeClaimTemplates"] if t["metadata"]["name"] == "state"]
    assert claim["accessModes"] == ["ReadWriteOnce"]
    models = tomllib.loads(config_file(objects)[1])["model"]
    for model in [models] if isinstance(models, str) else models:
        mount, volume = mount_at(pod, container, model)
        assert mount.get("readOnly") and volume["name"] == "models", model


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_tenants_secret_is_where_tenants_file_points(variant, tmp_path):
    objects = rendered(variant)
    values = tomllib.loads(config_file(objects)[1])
    tenants = tomllib.loads(secret_file(objects, values["tenants_file"]))
    assert set(tenants) == {"tenants"} and tenants["tenants"]
    placeholder = "0" * 64  # matches no key: the example refuses every request until a real hash replaces it
    assert [t["api_key_sha256"] for t in tenants["tenants"]] == [placeholder]
    pod, container = tokend_pod(objects)
    mount, volume = mount_at(pod, container, values["tenants_file"])
    assert mount.get("readOnly") and volume["secret"]["defaultMode"] & 0o007 == 0, "not readable by others"


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_are_grpc_health_on_the_grpc_port_and_grace_outlasts_the_drain(variant, tmp_path):
    objects = rendered(variant)
    config = loaded_config(objects, tmp_path)
    pod, container = tokend_pod(objects)
    for probe_name in ("startupProbe", "readinessProbe"):
        probe = container[probe_name]
        assert probe["grpc"] == {"port": config.grpc_port, "service": ""}, probe_name  # "" = every scheduler live
    # Alive while the frontend answers: a scheduler's reload or a drain must not get the pod killed.
    assert container["livenessProbe"]["grpc"] == {"port": config.grpc_port, "service": LIVENESS_SERVICE}
    startup = container["startupProbe"]
    window = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    assert window >= STARTUP_WINDOW_S
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop + config.drain_timeout + SHUTDOWN_AFTER_DRAIN_S, (grace, pre_stop, config.drain_timeout)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_pod_is_unprivileged_on_a_read_only_root(variant):
    objects = rendered(variant)
    pod, container = tokend_pod(objects)
    image_user = re.search(r"^USER\s+(\d+)", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    assert image_user and int(image_user.group(1)) == IMAGE_UID == pod["securityContext"]["runAsUser"]
    assert pod["securityContext"]["fsGroup"] == IMAGE_UID  # the state volume is writable by the tokend group
    assert pod["automountServiceAccountToken"] is False
    environment = pod_environment(objects)
    writable = [tomllib.loads(config_file(objects)[1])["state_dir"], environment["TOKEND_CACHE_DIR"], "/tmp"]
    for path in writable:  # all the daemon writes, with the root filesystem read-only
        mount, _ = mount_at(pod, container, path)
        assert not mount.get("readOnly"), path
    for controller in find(objects, "Deployment") + find(objects, "StatefulSet"):  # the endpoint picker too
        spec = controller["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for each in spec["containers"]:
            assert each["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }


def test_service_links_are_off_because_they_would_break_the_config(tmp_path):
    objects = rendered("cpu")
    pod, _ = tokend_pod(objects)
    assert pod["enableServiceLinks"] is False
    links = service_link_environment(objects)
    assert links["TOKEND_GRPC_PORT"].startswith("tcp://")  # the tokend-grpc Service's link: tokend's grpc_port
    with pytest.raises(ValueError, match="grpc_port|http_port"):
        loaded_config(objects, tmp_path, environ={**pod_environment(objects), **links})


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_pdb_and_monitors_select_the_tokend_pods_by_named_ports(variant):
    objects = rendered(variant)
    labels = workload(objects)["spec"]["template"]["metadata"]["labels"]
    _, container = tokend_pod(objects)
    port_names = {p["name"] for p in container["ports"]}

    def selects(selector: dict) -> bool:
        return selector.items() <= labels.items()

    services = {s["metadata"]["name"]: s for s in find(objects, "Service") if selects(s["spec"]["selector"])}
    headless = {"tokend-pods"} if workload(objects)["kind"] == "StatefulSet" else set()  # the pods' own names
    assert set(services) == {"tokend-grpc", "tokend-http"} | headless
    for name, protocol in (("tokend-grpc", "kubernetes.io/h2c"), ("tokend-http", "http")):
        (port,) = services[name]["spec"]["ports"]
        assert port["targetPort"] in port_names and port["appProtocol"] == protocol
    assert selects(one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"])
    for monitor in find(objects, "PodMonitor"):
        assert selects(monitor["spec"]["selector"]["matchLabels"])
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]


def test_the_cpu_overlay_runs_cpu_threads_within_its_cpu_limit(tmp_path):
    objects = rendered("cpu")
    config = loaded_config(objects, tmp_path)
    _, container = tokend_pod(objects)
    assert config.devices == ["cpu"]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits == requests, "Guaranteed QoS"
    assert 1 <= config.cpu_threads <= int(limits["cpu"]) - 1  # one core for the frontend and the gateway


def test_the_gpu_overlay_asks_for_one_gpu_on_a_gpu_node(tmp_path):
    objects = rendered("gpu")
    config = loaded_config(objects, tmp_path)
    pod, container = tokend_pod(objects)
    assert config.devices == ["cuda"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert one(objects, "Deployment", "tokend")["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":cu128")


def test_the_models_hostpath_component_replaces_the_models_claim():
    objects = rendered("cpu+models-hostpath")
    pod, _ = tokend_pod(objects)
    (models,) = [v for v in pod["volumes"] if v["name"] == "models"]
    assert set(models) == {"name", "hostPath"} and models["hostPath"]["type"] == "Directory"
    assert not find(objects, "PersistentVolumeClaim", "tokend-models")
    namespace = one(objects, "Namespace")["metadata"]["labels"]
    assert namespace["pod-security.kubernetes.io/enforce"] == "privileged"  # restricted forbids hostPath volumes


def test_the_inference_pool_routes_to_tokend_by_its_own_metrics(tmp_path):
    from frontend.metrics import FrontendMetrics

    objects = rendered("gpu-inference-pool")
    config = loaded_config(objects, tmp_path)
    pool = one(objects, "InferencePool")
    tokend_labels = one(objects, "Deployment", "tokend")["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= tokend_labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": config.http_port}]
    picker = pool["spec"]["endpointPickerRef"]
    service = one(objects, "Service", picker["name"])
    assert picker["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    route = one(objects, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]

    epp_pod = one(objects, "Deployment", "tokend-epp")["spec"]["template"]["spec"]
    assert epp_pod["serviceAccountName"] == one(objects, "RoleBinding")["subjects"][0]["name"]
    assert epp_pod["terminationGracePeriodSeconds"] >= tokend_pod(objects)[0]["terminationGracePeriodSeconds"]
    (epp,) = epp_pod["containers"]
    flags = dict(arg.removeprefix("--").split("=", 1) for arg in epp["args"])
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags["pool-group"] == "inference.networking.k8s.io"
    mount, volume = mount_at(epp_pod, epp, flags["config-file"])
    picker_config = yaml.safe_load(
        one(objects, "ConfigMap", volume["configMap"]["name"])["data"][
            os.path.relpath(flags["config-file"], mount["mountPath"])
        ]
    )
    assert picker_config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p for p in picker_config["plugins"]}
    for profile in picker_config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= set(plugins)

    # It scrapes tokend's metrics port, and reads names that tokend exports.
    assert plugins["metrics-data-source"]["parameters"]["port"] == config.metrics_port
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    assert tokend_labels["llm-d.ai/engine-type"] == engine["name"]
    exported = {family.name for family in FrontendMetrics().registry.collect()}
    specs = [engine["queuedRequestsSpec"], engine["runningRequestsSpec"], engine["kvUsageSpec"]]
    specs += [custom["metricSpec"] for custom in engine["customMetrics"]]
    assert {spec.split("{")[0] for spec in specs} <= exported
    assert specs[:3] == ["tokend:num_requests_waiting", "tokend:num_requests_running", "tokend:kv_cache_usage_perc"]
    attributes = {custom["attributeKey"]: custom["metricSpec"] for custom in engine["customMetrics"]}
    ttft_scorer = plugins["projected-ttft-scorer"]["parameters"]
    assert attributes[ttft_scorer["attributeKey"]] == "tokend:projected_ttft_seconds"
    assert ttft_scorer["algorithm"]["type"] == "linear_lower_is_better"
    assert flags["allow-experimental-plugins"] == "true"  # endpoint-attribute-scorer is alpha


@pytest.mark.parametrize("variant", ["gpu-keda", "gpu-hpa"])
def test_per_pod_state_gives_each_pod_its_own_ledger_and_the_overlays_pod(variant):
    """The StatefulSet runs the overlay's very pod (copied, not rewritten), with the state volume a claim per pod
    that outlives it; the shared claim and the one-replica Deployment are gone."""
    objects = rendered(variant)
    plain = rendered("gpu")
    statefulset = one(objects, "StatefulSet", "tokend")
    assert not find(objects, "Deployment", "tokend") and not find(objects, "PersistentVolumeClaim", "tokend-state")
    pod, expected = statefulset["spec"]["template"], yaml.safe_load(yaml.safe_dump(workload(plain)["spec"]["template"]))
    expected["spec"]["volumes"] = [v for v in expected["spec"]["volumes"] if v["name"] != "state"]
    assert pod == expected
    (template,) = statefulset["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == "state"
    assert statefulset["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenScaled": "Retain",
        "whenDeleted": "Retain",
    }
    governing = one(objects, "Service", statefulset["spec"]["serviceName"])
    assert governing["spec"]["clusterIP"] == "None"
    assert governing["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


@pytest.mark.parametrize("variant", ["gpu-keda", "gpu-hpa"])
def test_the_pods_scale_on_the_sum_of_their_own_desired_replicas(variant, tmp_path):
    """KEDA's ScaledObject or the HPA targets the StatefulSet with the sum of the pods' tokend:desired_replicas for
    the routed pool, averaged to 1 a pod (so the pods asked for are that sum), and the metric is one the frontend
    exports under that name and those labels; the pods it removes drain first."""
    from frontend.metrics import FrontendMetrics

    objects = rendered(variant)
    scaler = (find(objects, "ScaledObject") + find(objects, "HorizontalPodAutoscaler"))[0]
    target = scaler["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "StatefulSet", "tokend")
    metrics = FrontendMetrics()
    metrics.desired_replicas.labels("m", "mixed").set(2)
    exported = {m.name: m for m in metrics.registry.collect()}["tokend:desired_replicas"]
    if scaler["kind"] == "ScaledObject":
        (trigger,) = scaler["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        assert trigger["metadata"]["threshold"] == "1"
        query = trigger["metadata"]["query"]
        assert re.fullmatch(r'sum\(tokend:desired_replicas\{namespace="tokend", role=~"mixed\|decode"\}\)', query)
    else:
        (metric,) = scaler["spec"]["metrics"]
        assert metric["type"] == "External" and metric["external"]["target"] == {"type": "AverageValue",
                                                                                 "averageValue": "1"}  # fmt: skip
        assert metric["external"]["metric"]["selector"]["matchLabels"]["role"] == "mixed"
    assert exported.type == "gauge" and [sample.labels for sample in exported.samples] == [
        {"model_name": "m", "role": "mixed"}
    ]
    # A pod the scaler removes drains its streams before it stops (preStop, then the drain within the grace).
    config = loaded_config(objects, tmp_path)
    pod, container = tokend_pod(objects)
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + config.drain_timeout + SHUTDOWN_AFTER_DRAIN_S
