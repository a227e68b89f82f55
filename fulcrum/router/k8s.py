"""`fulcrum deploy k8s`: the fleet as Kubernetes manifests. Replicas are a Deployment of `fulcrum serve` behind a
headless Service (the router resolves it to every pod: `fulcrum router --discover`); the router is a Deployment
and the Service clients use; the replica count follows fulcrum's queue metric through an HPA (Pods metric, served
by a Prometheus adapter) or a KEDA ScaledObject (a Prometheus query)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import yaml

from fulcrum.defaults import VERSION

PORT = 8000
# what `make image-cpu` / `make image-cuda` build (docker/Dockerfile.cpu, docker/Dockerfile.cuda)
CPU_IMAGE, CUDA_IMAGE = f"fulcrum:{VERSION}-cpu", f"fulcrum:{VERSION}-cuda"
MODELS_MOUNT = "/models"  # where the models volume is mounted in every pod
KV_EVENTS_PORT, KV_REPLAY_PORT = 5557, 5558  # kv-events policy: each replica pod publishes there (vLLM's defaults)


@dataclass
class K8sConfig:
    name: str = "fulcrum"
    namespace: str | None = None
    image: str | None = None  # None: the image `make image-cpu` builds, or `make image-cuda`'s with gpus
    model: str = "/models/model"  # a path inside the image (or a mounted volume), or a Hub ID in its HF cache
    # a PersistentVolumeClaim holding the models, mounted read-only at /models in every pod (None: none mounted; the
    # model is in the image, as the bundled one is)
    models_claim: str | None = "fulcrum-models"
    serve_args: list[str] = field(default_factory=list)
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 4
    policy: str = "prefix"
    scaler: str = "hpa"  # hpa, keda or none
    target_waiting: float = 4.0  # requests waiting per replica the scaler holds
    prometheus: str = "http://prometheus.monitoring:9090"  # KEDA's query endpoint
    cpu: str = "4"
    memory: str = "16Gi"
    gpus: int = 0
    drain_timeout: int = 30


def _meta(cfg: K8sConfig, name: str, component: str) -> dict:
    meta = {"name": name, "labels": {"app.kubernetes.io/name": cfg.name, "app.kubernetes.io/component": component}}
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    return meta


def _probe(path: str, delay: int) -> dict:
    return {"httpGet": {"path": path, "port": PORT}, "initialDelaySeconds": delay, "periodSeconds": 5}


def _deployment(cfg: K8sConfig, name: str, component: str, command: list[str], replicas: int, resources: dict,
                grace: int, ports: tuple = ()) -> dict:  # fmt: skip
    labels = {"app.kubernetes.io/name": cfg.name, "app.kubernetes.io/component": component}
    container = {
        "name": component,
        "image": cfg.image or (CUDA_IMAGE if cfg.gpus else CPU_IMAGE),
        "command": command,
        "ports": [{"name": "http", "containerPort": PORT}, *ports],
        "readinessProbe": _probe("/health", 5),
        "livenessProbe": {**_probe("/health", 60), "failureThreshold": 6},
        "resources": resources,
    }
    pod_meta = {"labels": labels, "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORT)}}
    pod = {"terminationGracePeriodSeconds": grace, "containers": [container]}
    if cfg.models_claim:
        container["volumeMounts"] = [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True}]
        pod["volumes"] = [{"name": "models", "persistentVolumeClaim": {"claimName": cfg.models_claim,
                                                                        "readOnly": True}}]  # fmt: skip
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cfg, name, component),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": pod_meta,
                "spec": pod,
            },
        },
    }


def _service(cfg: K8sConfig, name: str, component: str, port: int, headless: bool) -> dict:
    spec = {
        "selector": {"app.kubernetes.io/name": cfg.name, "app.kubernetes.io/component": component},
        "ports": [{"name": "http", "port": port, "targetPort": PORT}],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = False
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(cfg, name, component), "spec": spec}


def render(cfg: K8sConfig) -> list[dict]:
    replica_name, router_name = f"{cfg.name}-replica", f"{cfg.name}-router"
    limits = {"cpu": cfg.cpu, "memory": cfg.memory}
    if cfg.gpus:
        limits["nvidia.com/gpu"] = str(cfg.gpus)
    serve = ["fulcrum", "serve", cfg.model, "--host", "0.0.0.0", "--port", str(PORT),
             "--drain-timeout", str(cfg.drain_timeout), *cfg.serve_args]  # fmt: skip
    route = ["fulcrum", "router", "--discover", f"{replica_name}:{PORT}", "--host", "0.0.0.0", "--port", str(PORT),
             "--policy", cfg.policy]  # fmt: skip
    if cfg.policy in ("prefix", "kv-events", "weighted"):
        route += ["--model", cfg.model]
    if cfg.policy == "kv-events":
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
                  "replay_endpoint": f"tcp://*:{KV_REPLAY_PORT}"}  # fmt: skip
        serve += ["--kv-events-config", json.dumps(events)]
        route += ["--kv-events-port", str(KV_EVENTS_PORT), "--kv-events-replay-port", str(KV_REPLAY_PORT)]
        ports = ({"name": "kv-events", "containerPort": KV_EVENTS_PORT},
                 {"name": "kv-replay", "containerPort": KV_REPLAY_PORT})  # fmt: skip
    else:
        ports = ()
    out = [
        _deployment(
            cfg,
            replica_name,
            "replica",
            serve,
            cfg.replicas,
            {"requests": limits, "limits": limits},
            cfg.drain_timeout + 10,
            ports,
        ),  # fmt: skip
        _service(cfg, replica_name, "replica", PORT, headless=True),
        _deployment(
            cfg,
            router_name,
            "router",
            route,
            1,
            {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
            30,
        ),  # fmt: skip
        _service(cfg, cfg.name, "router", 80, headless=False),
    ]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": replica_name}
    if cfg.scaler == "hpa":
        out.append({
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(cfg, replica_name, "replica"),
            "spec": {
                "scaleTargetRef": target,
                "minReplicas": cfg.min_replicas,
                "maxReplicas": cfg.max_replicas,
                # a Prometheus adapter serves fulcrum:num_requests_waiting as this Pods metric (':' is not allowed)
                "metrics": [{"type": "Pods", "pods": {
                    "metric": {"name": "fulcrum_num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": str(cfg.target_waiting)},
                }}],
                # Knative's stable window, as HPA spells it: no flapping down, quick up
                "behavior": {
                    "scaleDown": {"stabilizationWindowSeconds": 60, "policies": [
                        {"type": "Pods", "value": 1, "periodSeconds": 60}]},
                    "scaleUp": {"stabilizationWindowSeconds": 0},
                },
            },
        })  # fmt: skip
    elif cfg.scaler == "keda":
        selector = f'namespace="{cfg.namespace}",' if cfg.namespace else ""
        out.append({
            "apiVersion": "keda.sh/v1alpha1",
            "kind": "ScaledObject",
            "metadata": _meta(cfg, replica_name, "replica"),
            "spec": {
                "scaleTargetRef": {"name": replica_name},
                "minReplicaCount": cfg.min_replicas,
                "maxReplicaCount": cfg.max_replicas,
                "cooldownPeriod": 60,
                "triggers": [{"type": "prometheus", "metadata": {
                    "serverAddress": cfg.prometheus,
                    "query": f'sum(fulcrum:num_requests_waiting{{{selector}pod=~"{replica_name}-.*"}})',
                    "threshold": str(cfg.target_waiting),
                }}],
            },
        })  # fmt: skip
    elif cfg.scaler != "none":
        raise ValueError(f"unknown scaler {cfg.scaler!r}: hpa, keda or none")
    return out


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # a shared labels dict is written out each time, not as &id001
        return True


def to_yaml(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False)
