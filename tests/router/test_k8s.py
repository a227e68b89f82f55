"""`fulcrum deploy k8s`: the manifests validate against Kubernetes' own schemas (kubernetes-validate), and the
router finds the replicas through the headless Service."""

from __future__ import annotations

import pytest
import yaml

from fulcrum.cli import main
from fulcrum.router.k8s import K8sConfig, render, to_yaml

kv = pytest.importorskip("kubernetes_validate")
K8S_VERSION = "1.30.0"


@pytest.mark.parametrize("scaler", ["hpa", "keda", "none"])
def test_manifests_validate(scaler):
    docs = list(yaml.safe_load_all(to_yaml(render(K8sConfig(namespace="llm", scaler=scaler, gpus=1)))))
    kinds = [d["kind"] for d in docs]
    assert kinds[:4] == ["Deployment", "Service", "Deployment", "Service"]
    for d in docs:
        if d["apiVersion"].startswith("keda.sh"):
            continue  # a CRD: not in Kubernetes' schemas
        kv.validate(d, K8S_VERSION, strict=True)
    if scaler == "hpa":
        hpa = docs[-1]
        assert hpa["kind"] == "HorizontalPodAutoscaler"
        assert hpa["spec"]["scaleTargetRef"]["name"] == "fulcrum-replica"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    if scaler == "keda":
        assert docs[-1]["kind"] == "ScaledObject"
        assert "fulcrum:num_requests_waiting" in docs[-1]["spec"]["triggers"][0]["metadata"]["query"]
    replica_svc, router = docs[1], docs[2]
    assert replica_svc["spec"]["clusterIP"] == "None"
    command = router["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--discover") + 1] == "fulcrum-replica:8000"


def test_a_broken_manifest_is_caught():
    docs = render(K8sConfig())
    docs[0]["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(docs[0], K8S_VERSION, strict=True)


def test_cli_writes_the_manifests(tmp_path):
    out = tmp_path / "fleet.yaml"
    assert main(["deploy", "k8s", "--image", "me/fulcrum:1", "--max", "8", "--serve-arg", "--block-size 32",
                 "-o", str(out)]) == 0  # fmt: skip
    docs = list(yaml.safe_load_all(out.read_text()))
    serve = docs[0]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert serve[:2] == ["fulcrum", "serve"] and serve[-2:] == ["--block-size", "32"]
    assert docs[-1]["spec"]["maxReplicas"] == 8


def test_kv_events_policy_publishes_on_each_pod_and_the_router_subscribes():
    import json

    docs = render(K8sConfig(policy="kv-events"))
    for d in docs:
        if not d["apiVersion"].startswith("keda.sh"):
            kv.validate(d, K8S_VERSION, strict=True)
    replica = docs[0]["spec"]["template"]["spec"]["containers"][0]
    serve = replica["command"]
    events = json.loads(serve[serve.index("--kv-events-config") + 1])
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557"
    assert {p["containerPort"] for p in replica["ports"]} == {8000, 5557, 5558}
    route = docs[2]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert route[route.index("--kv-events-port") + 1] == "5557" and "--model" in route
    # what the router's CLI makes of that command line: each discovered pod's events on its own address
    from fulcrum.cli import build_parser
    from fulcrum.router.app import _on_host
    from fulcrum.router.cli import router_config

    cfg = router_config(build_parser().parse_args(route[1:]))
    assert cfg.policy == "kv-events" and _on_host("http://10.0.0.7:8000", cfg.kv_events_port) == "tcp://10.0.0.7:5557"


@pytest.mark.parametrize("gpus, image", [(0, "fulcrum:{v}-cpu"), (1, "fulcrum:{v}-cuda")])
def test_default_image_and_models_volume(gpus, image):
    """Without --image the pods run what `make image-cpu` / `make image-cuda` build; the models claim is mounted
    read-only at /models in replicas and router alike, and validates; --models-claim '' mounts none."""
    from fulcrum import __version__

    docs = render(K8sConfig(gpus=gpus))
    for d in docs[0], docs[2]:
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == image.format(v=__version__)
        assert container["volumeMounts"] == [{"name": "models", "mountPath": "/models", "readOnly": True}]
        assert pod["volumes"][0]["persistentVolumeClaim"] == {"claimName": "fulcrum-models", "readOnly": True}
        kv.validate(d, K8S_VERSION, strict=True)
    bare = render(K8sConfig(models_claim=None))[0]["spec"]["template"]["spec"]
    assert "volumes" not in bare and "volumeMounts" not in bare["containers"][0]
