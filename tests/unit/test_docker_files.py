"""Static checks of docker/: the image, compose, Prometheus, Grafana and the Kubernetes fleet.

No Docker engine is needed: hadolint lints the Dockerfile, kubernetes-validate checks the
manifests against the Kubernetes schemas (strict: unknown fields fail), and the rest is
parsed and cross-checked (mount paths, service names, ports, datasource ids, metric names).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.docker_files import (
    DASHBOARD,
    DOCKER,
    K8S,
    REPO,
    RULES,
    SCALED_OBJECT,
    adapter_config,
    load_yaml,
    metric_names,
    queried_metric_names,
)

BIN = Path(sys.executable).parent
CORE_MANIFESTS = ["namespace.yaml", "deployment.yaml", "service.yaml", "pdb.yaml", "hpa.yaml",
                  "prometheus-adapter-rules.yaml"]
KUBERNETES_VERSION = "1.31.0"


def tool(name: str) -> str:
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed: run make setup (it is pinned in requirements.lock)"
    return path


def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install curl\n")
    result = subprocess.run([tool("hadolint"), str(bad)], capture_output=True, text=True)
    assert result.returncode != 0 and "DL3007" in result.stdout  # latest tag


def test_the_image_is_the_triton_release_the_wheel_carries():
    text = (DOCKER / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/tritonserver:24.10-py3\n" in text  # tritonserver 2.51
    assert "nvidia-pytriton==0.7.0" in (REPO / "requirements.lock").read_text()  # also 2.51
    assert '"onnxruntime-gpu==1.20.2"' in text and "requirements.lock" in text
    assert "--triton-home" in text and "/v2/health/ready" in text
    for folder in ("python_backends", "tools", "loadtest", "model_repository", "profiles"):
        assert f"COPY {folder} ./{folder}" in text, folder


@pytest.mark.parametrize("manifest", CORE_MANIFESTS)
def test_kubernetes_manifests_validate_strictly(manifest):
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                             str(K8S / manifest)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_validate_does_catch_a_bad_manifest(tmp_path):
    deployment = load_yaml(K8S / "deployment.yaml")
    deployment["spec"]["replicas"] = "two"
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    bad = tmp_path / "deployment.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(bad)],
                            capture_output=True, text=True)
    assert result.returncode != 0


def test_kustomization_lists_every_core_manifest_in_one_namespace():
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(CORE_MANIFESTS)
    for manifest in CORE_MANIFESTS:
        document = load_yaml(K8S / manifest)
        namespace = document["metadata"]["name"] if document["kind"] == "Namespace" else \
            document["metadata"]["namespace"]
        assert namespace == kustomization["namespace"], manifest


def deployment_container() -> dict:
    return load_yaml(K8S / "deployment.yaml")["spec"]["template"]["spec"]["containers"][0]


def test_deployment_has_a_gpu_probes_and_a_drain():
    deployment = load_yaml(K8S / "deployment.yaml")
    pod = deployment["spec"]["template"]["spec"]
    container = deployment_container()
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120  # model loading takes tens of seconds
    sleep_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert sleep_s >= 5
    # preStop, then the server's own drain (exit timeout 30 s), must fit in the grace period.
    assert pod["terminationGracePeriodSeconds"] >= sleep_s + 30
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002, "llm-api": 9000}
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8002"


def test_service_and_pdb_select_the_deployments_pods():
    labels = load_yaml(K8S / "deployment.yaml")["spec"]["template"]["metadata"]["labels"]
    for manifest, path in (("service.yaml", ("spec", "selector")), ("pdb.yaml", ("spec", "selector", "matchLabels"))):
        selector = load_yaml(K8S / manifest)
        for key in path:
            selector = selector[key]
        assert selector.items() <= labels.items(), manifest


def test_hpa_scales_the_deployment_on_metrics_the_adapter_serves():
    hpa = load_yaml(K8S / "hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tritonserver"}
    wanted = {m[m["type"].lower()]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    config = adapter_config()
    served = {rule["name"]["as"] for rule in config["rules"] + config["externalRules"]}
    assert wanted == served == {"triton_pending_requests", "triton_queue_us_per_request", "triton_demand_ratio"}
    behavior = hpa["spec"]["behavior"]
    assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300  # GPU pods: come down slowly


def test_keda_scaled_object_targets_the_deployment_with_prometheus_triggers():
    scaled = load_yaml(SCALED_OBJECT)
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == load_yaml(K8S / "deployment.yaml")["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    triggers = scaled["spec"]["triggers"]
    assert {t["name"] for t in triggers} == {"pending-requests", "queue-time", "demand"}
    for trigger in triggers:
        assert trigger["type"] == "prometheus"
        assert trigger["metadata"]["query"].strip() and float(trigger["metadata"]["threshold"]) > 0


def compose() -> dict:
    return load_yaml(DOCKER / "compose.yaml")


def test_compose_builds_the_image_and_mounts_only_files_that_exist():
    services = compose()["services"]
    assert set(services) == {"tritonserver", "prometheus", "grafana", "locust"}
    build = services["tritonserver"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()
    devices = services["tritonserver"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    named = set(compose().get("volumes", {}))
    for name, service in services.items():
        assert ":latest" not in service.get("image", ":x"), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source in named:
                continue
            host = (DOCKER / source).resolve()
            assert host.exists(), f"{name} mounts {host}, which does not exist"


def test_locust_and_the_server_share_the_tenant_keys_file():
    # The mix's tenants send tokens signed with the spec's keys file, which the server verifies.
    from tools.spec.serving import load_spec

    services = compose()["services"]
    keys_dir = load_spec(REPO / "serving.toml").tenant_auth.keys_file.parent.relative_to(REPO)
    mount = f"kit-build:/opt/kit/{keys_dir}"
    assert mount in services["tritonserver"]["volumes"] and mount in services["locust"]["volumes"]
    assert "kit-build" in compose()["volumes"]
    assert "WORKDIR /opt/kit" in (DOCKER / "Dockerfile").read_text()
    assert services["locust"]["profiles"] == ["load"]  # `up` without the profile needs no locustfile


def test_the_locust_service_runs_this_kits_locustfile_against_the_server_service():
    services = compose()["services"]
    locust = services["locust"]
    assert locust["image"] == services["tritonserver"]["image"]  # locust and tritonclient are in the lock
    entrypoint = locust["entrypoint"]
    assert entrypoint[:3] == ["python", "-m", "locust"]
    assert (REPO / entrypoint[entrypoint.index("-f") + 1]).is_file()
    command = locust["command"]
    assert command[command.index("--triton-grpc") + 1] == "tritonserver:8001"
    assert command[command.index("--triton-http") + 1] == "tritonserver:8000"
    mix = command[command.index("--mix") + 1]
    assert (REPO / "loadtest" / "mixes" / f"{mix}.toml").is_file()
    assert "COPY loadtest ./loadtest" in (DOCKER / "Dockerfile").read_text()
    lock = (REPO / "requirements.lock").read_text()
    assert "\nlocust==" in lock and "\ntritonclient" in lock


def test_prometheus_scrapes_the_servers_metrics_port_and_loads_the_rules():
    services = compose()["services"]
    config = load_yaml(DOCKER / "prometheus" / "prometheus.yml")
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["tritonserver:8002"]
    assert "8002:8002" in services["tritonserver"]["ports"]
    mounted = {v.split(":")[1] for v in services["prometheus"]["volumes"]}
    assert set(config["rule_files"]) <= mounted
    rules = load_yaml(RULES)
    names = [r.get("record") or r.get("alert") for g in rules["groups"] for r in g["rules"]]
    assert len(names) == len(set(names)) and all(names)


def test_grafana_provisions_the_datasource_and_dashboard_the_panels_use():
    services = compose()["services"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"])
    (datasource,) = load_yaml(DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = load_yaml(DOCKER / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml")["providers"]
    assert provider["options"]["path"] == mounts["./grafana/dashboards"]
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("queue vs compute", "batch sizes", "p95 against the slo", "padding waste", "time to first token",
                  "kv-cache blocks", "rejections per tenant"):
        assert topic in titles, topic


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.95, sum by (le) (rate(embed_request_duration_seconds_bucket{model="embed"}[1m]))) * 1000',
     {"embed_request_duration_seconds_bucket"}),
    ("sum by (model) (rate(nv_inference_queue_duration_us[$__rate_interval])) / "
     "clamp_min(sum by (model) (rate(nv_inference_request_success[1m])), 1e-9) / 1000",
     {"nv_inference_queue_duration_us", "nv_inference_request_success"}),
    ('sum(nv_inference_pending_request_count{<<.LabelMatchers>>,model=~"encoder_.*"}) by (<<.GroupBy>>)',
     {"nv_inference_pending_request_count"}),
    ('router:latency_p95_ms:rate1m{model="embed"} > 200 and on (model) vector(1)', set()),
    ("nv_cpu_utilization", {"nv_cpu_utilization"}),
])
def test_metric_names_reads_metrics_not_functions_labels_or_numbers(expr, names):
    assert metric_names(expr) == names


def test_every_query_reads_the_kit_or_triton_metrics():
    queried = queried_metric_names()
    assert {"nv_inference_pending_request_count", "nv_inference_queue_duration_us",
            "embed_tenant_requests_total"} <= queried.keys()
    for name in queried:
        assert name.startswith(("nv_", "embed_", "llm_")), name


def test_the_admin_key_comes_from_a_secret_never_from_the_repository():
    env = {entry["name"]: entry for entry in deployment_container()["env"]}
    assert "value" not in env["TRITON_ADMIN_KEY"]  # a literal would be a key baked into the repo
    assert env["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "triton-admin-key", "key": "key"}
    server = compose()["services"]["tritonserver"]
    # `${VAR:?message}`: compose refuses to start when the operator has not exported a key.
    assert server["environment"]["TRITON_ADMIN_KEY"].startswith("${TRITON_ADMIN_KEY:?")
