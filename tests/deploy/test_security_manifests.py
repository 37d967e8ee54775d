"""The k8s manifests' security wiring: every sidecar reads the control-plane key from the one
Secret, and the NetworkPolicies admit exactly the traffic the pods need (evaluated here with
Kubernetes' own rules over the manifests' labels and ports)."""

from __future__ import annotations

import functools
import stat
from pathlib import Path
from typing import Any

import pytest

from app.config import env_var_for, load_settings
from app.errors import ConfigError
from app.transfer.wire.auth import MIN_KEY_BYTES, FrameAuth, load_auth
from tests.deploy.test_manifests import (
    K8S,
    POD_FILES,
    _all_docs,
    _docs,
    _env,
    _env_values,
    _one,
    _pod,
    _pod_containers,
    _settings_of,
    _sidecar,
)

AUTH_EXAMPLE = "auth-key-secret.example.yaml"
POLICY_FILE = "networkpolicy.yaml"
MC_RANGE_VARS = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")


# --- the control-plane key --------------------------------------------------------------------


def _key_mount(spec: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(file path, volume mount, volume) of the sidecar's KVSIDECAR_AUTH_KEY_FILE."""
    sidecar = _sidecar(spec)
    path = _env_values(sidecar)[env_var_for("auth_key_file")]
    mounts = [
        m for m in sidecar["volumeMounts"] if Path(path).parent == Path(m["mountPath"].rstrip("/"))
    ]
    assert len(mounts) == 1, f"{path} is not directly under one volume mount of the sidecar"
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    return path, mounts[0], volume


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_sidecar_reads_the_key_from_the_example_secret(role: str) -> None:
    secret = _one(_docs(K8S / AUTH_EXAMPLE), "Secret")
    spec = _pod(role)["spec"]
    env = _env(_sidecar(spec))
    # A file: a key in an env value shows in `kubectl describe` and /proc/<pid>/environ.
    assert env_var_for("auth_key") not in env
    path, mount, volume = _key_mount(spec)
    assert mount.get("readOnly") is True
    source = volume.get("secret")
    assert source, f"{path} must come from a Secret volume"
    assert source["secretName"] == secret["metadata"]["name"]
    items = {i["path"]: i["key"] for i in source.get("items", [])}
    key = items.get(Path(path).name, Path(path).name)
    assert key in secret["stringData"], f"Secret has no key {key!r}"
    # Not world-readable; the group is the pod's fsGroup, which is the sidecar's group.
    mode = source.get("defaultMode", 0o644)
    assert not mode & stat.S_IRWXO, f"defaultMode {mode:o} lets every user of the node read it"
    assert spec["securityContext"]["fsGroup"] == _sidecar(spec)["securityContext"]["runAsGroup"]
    # No other container mounts it: the engine never needs the key.
    others = [c for c in _pod_containers(spec) if c is not _sidecar(spec)]
    assert not [c["name"] for c in others for m in c.get("volumeMounts", []) if m is mount]
    assert not [
        c["name"] for c in others for m in c.get("volumeMounts", []) if m["name"] == volume["name"]
    ]


def test_prefill_and_decode_share_one_key() -> None:
    sources = {role: _key_mount(_pod(role)["spec"])[2]["secret"] for role in POD_FILES}
    assert len({s["secretName"] for s in sources.values()}) == 1


def test_example_secret_placeholder_is_refused(tmp_path: Path) -> None:
    """Applied by mistake, the example's placeholder must stop the sidecar, not become a key."""
    secret = _one(_docs(K8S / AUTH_EXAMPLE), "Secret")
    assert len(secret["stringData"]["key"].strip()) < MIN_KEY_BYTES


@pytest.mark.parametrize("role", sorted(POD_FILES))
def test_sidecar_settings_load_the_mounted_key(
    role: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pod = _pod(role)
    settings = _settings_of(pod, monkeypatch, tmp_path)
    assert settings.control_host == "0.0.0.0"  # reachable: validation demands the key
    assert settings.auth_key_file is not None
    # Stand in for the kubelet: the Secret's file at a local path, then load it as serve would.
    stand_in = tmp_path / "secret" / "key"
    stand_in.parent.mkdir()
    stand_in.write_text("s" * 64)
    local = settings.model_copy(update={"auth_key_file": stand_in})
    assert load_auth(local) == FrameAuth(b"s" * 64)
    stand_in.write_text(_one(_docs(K8S / AUTH_EXAMPLE), "Secret")["stringData"]["key"])
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        load_auth(local)
    # Without the variable, the manifest's settings are refused outright.
    monkeypatch.delenv(env_var_for("auth_key_file"))
    with pytest.raises(ConfigError, match=r"no control-plane key is set.*KVSIDECAR_AUTH_KEY_FILE"):
        load_settings({}, tmp_path / "sidecar.toml")


# --- NetworkPolicies ------------------------------------------------------------------------


@functools.cache
def _policies() -> list[dict[str, Any]]:
    return [d for d in _docs(K8S / POLICY_FILE) if d["kind"] == "NetworkPolicy"]


@functools.cache
def _deployments() -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _all_docs() if d["kind"] == "Deployment"}


def _labels(name: str) -> dict[str, str]:
    labels: dict[str, str] = _deployments()[name]["spec"]["template"]["metadata"]["labels"]
    return labels


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector, as the API server evaluates it."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _port_ok(rule_port: dict[str, Any], port: int, pod: dict[str, Any]) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    want = rule_port.get("port")
    if want is None:
        return True
    if isinstance(want, str):  # a named port: whatever the pod's containers call it
        named = {
            p["name"]: p["containerPort"]
            for c in _pod_containers(pod["spec"]["template"]["spec"])
            for p in c.get("ports", [])
            if "name" in p
        }
        return named.get(want) == port
    return bool(want <= port <= rule_port.get("endPort", want))


def _admitted(source: dict[str, str], target: str, port: int) -> bool:
    """Whether a pod labelled ``source`` (same namespace) may connect to ``target``'s port."""
    pod = _deployments()[target]
    selecting = [
        p
        for p in _policies()
        if _matches(p["spec"]["podSelector"], _labels(target))
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True  # no policy selects the pod: everything is admitted
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            peers = rule.get("from")
            peer_ok = not peers or any(
                "podSelector" in peer
                and "namespaceSelector" not in peer
                and _matches(peer["podSelector"], source)
                for peer in peers
            )
            ports = rule.get("ports")
            port_ok = not ports or any(_port_ok(p, port, pod) for p in ports)
            if peer_ok and port_ok:
                return True
    return False


PREFILL, DECODE, PROXY, MASTER = (
    "vllm-prefill",
    "vllm-decode",
    "kv-sidecar-proxy",
    "mooncake-master",
)
STRANGER = {"app.kubernetes.io/name": "someone-else", "app": "attacker"}


def _mooncake_range(role_deployment: str) -> tuple[int, int]:
    spec = _deployments()[role_deployment]["spec"]["template"]["spec"]
    env = _env_values(_sidecar(spec))
    low, high = (int(env[name]) for name in MC_RANGE_VARS)
    assert 1024 < low < high < 65536
    return low, high


def test_policies_select_pods_that_exist() -> None:
    names = set(_deployments())
    assert {PREFILL, DECODE, MASTER} <= names
    selected = set()
    for policy in _policies():
        found = {n for n in names if _matches(policy["spec"]["podSelector"], _labels(n))}
        assert found, f"NetworkPolicy {policy['metadata']['name']} selects no pod"
        selected |= found
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                assert "ipBlock" not in peer, "pod IPs change; select peers by label"
                assert any(_matches(peer["podSelector"], _labels(n)) for n in names), peer
    assert {PREFILL, DECODE, MASTER} <= selected


@pytest.mark.parametrize("target", [PREFILL, DECODE, MASTER])
def test_every_declared_port_is_admitted_and_nothing_else(target: str) -> None:
    """Each container port reaches some source; a rule names only declared ports (by number or
    name) or, on the sidecar pods, exactly the Mooncake range."""
    pod = _deployments()[target]
    containers = _pod_containers(pod["spec"]["template"]["spec"])
    declared = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    names = {p["name"] for c in containers for p in c.get("ports", []) if "name" in p}
    sources = [_labels(n) for n in _deployments()] + [STRANGER]
    for port in declared:
        assert any(_admitted(s, target, port) for s in sources), f"{target}:{port} unreachable"
    allowed_ranges = set() if target == MASTER else {_mooncake_range(target)}
    for policy in _policies():
        if not _matches(policy["spec"]["podSelector"], _labels(target)):
            continue
        for rule in policy["spec"]["ingress"]:
            assert rule.get("ports"), f"{policy['metadata']['name']}: a rule admits every port"
            for port in rule["ports"]:
                want = port["port"]
                if "endPort" in port:
                    assert (want, port["endPort"]) in allowed_ranges, port
                elif isinstance(want, str):
                    assert want in names, f"{target} declares no port named {want!r}"
                else:
                    assert want in declared, f"{target} admits undeclared port {want}"


def test_control_and_mooncake_ports_admit_only_peer_sidecars() -> None:
    control = {
        r: int(_env_values(_sidecar(_pod(r)["spec"]))["KVSIDECAR_CONTROL_PORT"]) for r in POD_FILES
    }
    prefill, decode = _labels(PREFILL), _labels(DECODE)
    # Control: from the other role's sidecars only.
    assert _admitted(prefill, DECODE, control["decode"])
    assert _admitted(decode, PREFILL, control["prefill"])
    for source in (STRANGER, _labels(PROXY), _labels(MASTER)):
        assert not _admitted(source, DECODE, control["decode"]), source
        assert not _admitted(source, PREFILL, control["prefill"]), source
    assert not _admitted(decode, DECODE, control["decode"])
    # Mooncake: every port of the range, from every sidecar pod (the pool), from no one else.
    for target in (PREFILL, DECODE):
        low, high = _mooncake_range(target)
        for port in (low, (low + high) // 2, high):
            assert _admitted(prefill, target, port) and _admitted(decode, target, port)
            for source in (STRANGER, _labels(PROXY), _labels(MASTER)):
                assert not _admitted(source, target, port), (source, target, port)
        assert not _admitted(prefill, target, low - 1)
        assert not _admitted(prefill, target, high + 1)


def test_engine_api_admin_and_master_are_reachable_as_intended() -> None:
    for target in (PREFILL, DECODE):
        # vLLM: the proxy only.
        assert _admitted(_labels(PROXY), target, 8000)
        assert not _admitted(STRANGER, target, 8000)
        # Admin: as before the policies (probes, Prometheus); mutations need the token.
        assert _admitted(STRANGER, target, 8300)
    assert _admitted(_labels(PREFILL), MASTER, 50051)
    assert _admitted(_labels(DECODE), MASTER, 50051)
    assert not _admitted(STRANGER, MASTER, 50051)
    assert not _admitted(_labels(PROXY), MASTER, 50051)
    assert _admitted(STRANGER, MASTER, 9003)


def test_mooncake_range_is_the_wheels_default_and_the_same_on_both_sides() -> None:
    """The policy and the env agree; the env values are Mooncake's own defaults (15000-17000),
    so a pod that lost them would still bind inside the admitted range."""
    assert _mooncake_range(PREFILL) == _mooncake_range(DECODE) == (15000, 17000)
    for policy in _policies():
        for rule in policy["spec"]["ingress"]:
            for port in rule.get("ports", []):
                if "endPort" in port:
                    assert (port["port"], port["endPort"]) == (15000, 17000)
