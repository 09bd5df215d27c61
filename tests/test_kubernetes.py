"""deploy/kubernetes/: valid against the Kubernetes schemas (kubernetes-validate ships them, so
this runs offline), wired together (Service -> Pods, probes -> ports, Redis URL -> Service),
hardened (non-root, read-only root, resources), and configured with a TOML and environment
that streamfence's own config loader accepts."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from proxy.config.load import load
from proxy.config.schema import Config
from proxy.server import shutdown

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.30.0"  # the oldest Kubernetes these files are meant for (native sidecars: 1.29)
Doc = dict[str, Any]


def docs(name: str) -> list[Doc]:
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


def one(documents: list[Doc], kind: str, name: str) -> Doc:
    (found,) = [d for d in documents if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def streamfence_container(pod: Doc) -> Doc:
    every = pod.get("initContainers", []) + pod["containers"]
    (found,) = [c for c in every if c["name"] == "streamfence"]
    return found


def config_of(documents: list[Doc], container: Doc, tmp_path: Path) -> Config:
    """What streamfence would run with: the mounted ConfigMap file plus the container's env."""
    args = container["args"]
    path = args[args.index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    pod = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = one(documents, "ConfigMap", volume["configMap"]["name"])
    toml = tmp_path / "streamfence.toml"
    toml.write_text(configmap["data"][path.removeprefix(mount["mountPath"] + "/")])
    env = {e["name"]: e.get("value", "secret-from-a-secretKeyRef") for e in container["env"]}
    return load(str(toml), env=env)


@pytest.mark.parametrize("name", ["sidecar.yaml", "gateway.yaml"])
def test_every_resource_is_valid_against_the_kubernetes_schemas(name: str) -> None:
    documents = docs(name)
    assert documents
    for doc in documents:
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises on any problem


def test_the_validator_rejects_a_misspelt_field() -> None:
    # Strict mode is what catches typos: prove it is on, or the test above proves nothing.
    deployment = copy.deepcopy(one(docs("gateway.yaml"), "Deployment", "streamfence"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSION, strict=True)


def _hardened(container: Doc) -> None:
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["requests"]["memory"]
    assert container["resources"]["limits"]["memory"]


def _grace_fits(pod: Doc, config: Config) -> None:
    # The Pod's stop timeout must outlast the proxy's own shutdown, or streams get SIGKILL.
    worst = shutdown.uvicorn_timeout(config.server.shutdown_grace)
    assert pod.get("terminationGracePeriodSeconds", 30) > worst


def test_the_sidecar_pod(tmp_path: Path) -> None:
    documents = docs("sidecar.yaml")
    pod = one(documents, "Deployment", "agent")["spec"]["template"]["spec"]
    proxy = streamfence_container(pod)
    assert proxy.get("restartPolicy") == "Always"  # a native sidecar, started first
    _hardened(proxy)
    config = config_of(documents, proxy, tmp_path)
    assert config.server.host == "127.0.0.1"  # the Pod's loopback only
    _grace_fits(pod, config)
    port = config.server.port
    probes = {kind: proxy[kind] for kind in ("livenessProbe", "readinessProbe", "startupProbe")}
    urls = {kind: p["exec"]["command"][-1] for kind, p in probes.items()}
    assert f"http://127.0.0.1:{port}/_streamfence/healthz" in urls["livenessProbe"]
    assert f"http://127.0.0.1:{port}/_streamfence/readyz" in urls["readinessProbe"]
    assert "ProxyHandler({})" in urls["readinessProbe"]  # HTTPS_PROXY must not catch it
    (agent,) = pod["containers"]
    base_url = next(e["value"] for e in agent["env"] if e["name"] == "OPENAI_BASE_URL")
    assert base_url == f"http://127.0.0.1:{port}/v1"


def test_the_shared_gateway(tmp_path: Path) -> None:
    documents = docs("gateway.yaml")
    deployment = one(documents, "Deployment", "streamfence")
    assert deployment["spec"]["replicas"] >= 2
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pod = deployment["spec"]["template"]["spec"]
    proxy = streamfence_container(pod)
    _hardened(proxy)
    config = config_of(documents, proxy, tmp_path)
    _grace_fits(pod, config)
    # Shared fencing: every replica uses the one Redis, reached through its Service.
    assert config.registry.backend == "redis"
    redis_host = urlsplit(config.registry.url).hostname
    redis_service = one(documents, "Service", str(redis_host))
    redis = one(documents, "Deployment", str(redis_host))
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert redis_service["spec"]["selector"].items() <= redis_labels.items()
    redis_pod = redis["spec"]["template"]["spec"]
    (redis_container,) = redis_pod["containers"]
    assert redis_pod["securityContext"]["runAsNonRoot"] is True
    assert redis_container["securityContext"]["readOnlyRootFilesystem"] is True
    # Beyond loopback, so a token is required, from a Secret.
    assert config.server.host == "0.0.0.0" and config.server.access_token
    token = next(e for e in proxy["env"] if e["name"] == "STREAMFENCE_SERVER_ACCESS_TOKEN")
    assert "secretKeyRef" in token["valueFrom"]
    # The Service reaches the container port the proxy listens on; the probes too.
    (port,) = proxy["ports"]
    assert port["containerPort"] == config.server.port
    service = one(documents, "Service", "streamfence")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] in (port["name"], port["containerPort"])
    assert proxy["livenessProbe"]["httpGet"] == {"path": "/_streamfence/healthz", "port": "http"}
    assert proxy["readinessProbe"]["httpGet"] == {"path": "/_streamfence/readyz", "port": "http"}
    budget = one(documents, "PodDisruptionBudget", "streamfence")
    assert budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
