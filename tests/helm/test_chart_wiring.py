"""What the rendered chart connects to what: Secrets, RAY_ADDRESS, GPUs, probes, security, hooks, storage.

Each test reads the rendered manifests (conftest.render) and fails when one piece points somewhere else."""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest

from tests.helm.conftest import (
    NAMESPACE,
    Rendered,
    Renderer,
    ci_values,
    container,
    deep_merge,
    env_of,
    pod_spec,
    ray_pod_specs,
    secret_ref,
)

BALLAST_WORKLOADS = ("api", "scheduler")


def _ballast_pods(r: Rendered) -> dict[str, dict[str, Any]]:
    """The API, scheduler and migration workloads by component."""
    pods = {c: r.deployment(c) for c in BALLAST_WORKLOADS}
    pods["migrations"] = r.job()
    return pods


# ---------------------------------------------------------------------------------------------- database
@pytest.mark.parametrize("values", ["default", "ci"])
def test_one_dsn_secret_feeds_api_scheduler_and_migrations(
    values: str, default_render: Rendered, ci_render: Rendered
) -> None:
    r = default_render if values == "default" else ci_render
    refs = {name: secret_ref(env_of(container(w))["BALLAST_DATABASE_URL"]) for name, w in _ballast_pods(r).items()}
    assert refs == dict.fromkeys(refs, ("ballast-database", "url"))


def test_dsn_secret_name_and_key_come_from_values(render: Renderer) -> None:
    r = render({"database": {"existingSecret": "prod-pg", "urlKey": "dsn"}})
    for w in _ballast_pods(r).values():
        assert secret_ref(env_of(container(w))["BALLAST_DATABASE_URL"]) == ("prod-pg", "dsn")


def test_no_database_secret_is_refused(render: Renderer) -> None:
    with pytest.raises(helm.HelmError, match="database.existingSecret is required"):
        render({"database": {"existingSecret": ""}})


# ---------------------------------------------------------------------------------------------------- Ray
@pytest.mark.parametrize("values", ["default", "ci"])
def test_ray_address_is_the_head_services_client_port(
    values: str, default_render: Rendered, ci_render: Rendered
) -> None:
    r = default_render if values == "default" else ci_render
    cluster = r.raycluster()
    head = cluster["spec"]["headGroupSpec"]
    # KubeRay names the head Service <RayCluster name>-head-svc and exposes the head container's ports on it
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert head["rayStartParams"]["ray-client-server-port"] == str(ports["client"])
    expected = f"ray://{cluster['metadata']['name']}-head-svc:{ports['client']}"
    assert len(f"{cluster['metadata']['name']}-head-svc") <= 63
    for component in BALLAST_WORKLOADS:
        assert env_of(container(r.deployment(component)))["RAY_ADDRESS"] == {"name": "RAY_ADDRESS", "value": expected}


def test_long_release_names_still_give_a_valid_head_service_name(render: Renderer) -> None:
    r = render({"fullnameOverride": "x" * 63})
    name = r.raycluster()["metadata"]["name"]
    assert len(f"{name}-head-svc") <= 63
    assert env_of(container(r.deployment("scheduler")))["RAY_ADDRESS"]["value"] == f"ray://{name}-head-svc:10001"


def test_an_existing_ray_cluster_replaces_the_raycluster(render: Renderer) -> None:
    address = "ray://shared-ray-head-svc.ray.svc.cluster.local:10001"
    r = render({"ray": {"address": address}})
    assert r.all("RayCluster") == []
    for component in BALLAST_WORKLOADS:
        assert env_of(container(r.deployment(component)))["RAY_ADDRESS"]["value"] == address


def test_no_ray_at_all_is_refused(render: Renderer) -> None:
    with pytest.raises(helm.HelmError, match="set ray.address"):
        render({"rayCluster": {"enabled": False}})


def test_gpu_workers_get_nvidia_gpu_limits(ci_render: Rendered) -> None:
    (group,) = ci_render.raycluster()["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == ci_values()["rayCluster"]["worker"]["gpus"] == 1
    # the CPU and memory limits given in values are kept next to the GPU
    assert worker["resources"]["limits"]["cpu"] == "8"
    assert group["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert group["groupName"] == "gpu"


def test_cpu_only_by_default(default_render: Rendered) -> None:
    text = json.dumps(default_render.docs)
    assert "nvidia.com/gpu" not in text


def test_worker_replica_bounds_are_consistent(default_render: Rendered, ci_render: Rendered) -> None:
    for r in (default_render, ci_render):
        for g in r.raycluster()["spec"]["workerGroupSpecs"]:
            assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]


def test_autoscaler_options_only_with_autoscaling(default_render: Rendered, ci_render: Rendered) -> None:
    off, on = default_render.raycluster()["spec"], ci_render.raycluster()["spec"]
    assert off["enableInTreeAutoscaling"] is False and "autoscalerOptions" not in off
    idle = ci_values()["rayCluster"]["autoscaling"]["idleTimeoutSeconds"]
    assert on["autoscalerOptions"]["idleTimeoutSeconds"] == idle


def test_ray_pods_are_recreated_on_a_new_image_but_not_on_a_new_chart_version(
    default_render: Rendered, render: Renderer
) -> None:
    spec = default_render.raycluster()["spec"]
    assert spec["upgradeStrategy"] == {"type": "Recreate"}
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for t in templates:
        assert "helm.sh/chart" not in t["metadata"]["labels"]
    retagged = render({"image": {"tag": "0.2.0"}}).raycluster()["spec"]
    assert retagged["headGroupSpec"]["template"] != spec["headGroupSpec"]["template"]
    assert "upgradeStrategy" not in render({"rayCluster": {"upgradeStrategy": ""}}).raycluster()["spec"]


def test_ray_version_is_set(default_render: Rendered) -> None:
    # KubeRay >= 1.6 probes Ray >= 2.53 over HTTP; older Ray versions get wget probes the image cannot run
    major, minor, *_ = (int(x) for x in default_render.raycluster()["spec"]["rayVersion"].split("."))
    assert (major, minor) >= (2, 53)


# -------------------------------------------------------------------------------------------- API and auth
def test_api_runs_serve_without_scheduler_or_migrations(default_render: Rendered) -> None:
    assert container(default_render.deployment("api"))["command"] == [
        "ballast", "serve", "--no-scheduler", "--no-migrate"
    ]
    assert container(default_render.deployment("scheduler"))["command"] == ["ballast", "scheduler", "--no-migrate"]


def test_api_serves_with_token_auth_on_all_interfaces(default_render: Rendered) -> None:
    env = env_of(container(default_render.deployment("api")))
    assert env["BALLAST_AUTH_MODE"]["value"] == "token"
    assert env["BALLAST_BIND_HOST"]["value"] == "0.0.0.0"
    assert secret_ref(env["BALLAST_TOKEN_PEPPER"]) == ("ballast-auth", "pepper")


def test_probes_hit_health_endpoints_on_the_served_port(default_render: Rendered, render: Renderer) -> None:
    for r, port in ((default_render, 8420), (render({"api": {"port": 9000}}), 9000)):
        api = container(r.deployment("api"))
        (cport,) = api["ports"]
        assert cport == {"name": "http", "containerPort": port, "protocol": "TCP"}
        assert env_of(api)["BALLAST_BIND_PORT"]["value"] == str(port)
        assert api["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
        assert api["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
        service = r.one("Service")
        assert service["spec"]["ports"][0]["port"] == port
        assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_service_selects_only_api_pods(default_render: Rendered) -> None:
    selector = default_render.one("Service")["spec"]["selector"]
    api_labels = pod_template_labels(default_render.deployment("api"))
    sched_labels = pod_template_labels(default_render.deployment("scheduler"))
    assert selector.items() <= api_labels.items()
    assert not selector.items() <= sched_labels.items()


def pod_template_labels(workload: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


def test_deployment_selectors_match_their_pods(default_render: Rendered) -> None:
    for component in BALLAST_WORKLOADS:
        d = default_render.deployment(component)
        assert d["spec"]["selector"]["matchLabels"].items() <= pod_template_labels(d).items()


def test_ingress_routes_to_the_api_service(ci_render: Rendered) -> None:
    ingress = ci_render.one("Ingress")
    service = ci_render.one("Service")
    backends = [p["backend"]["service"] for rule in ingress["spec"]["rules"] for p in rule["http"]["paths"]]
    assert backends and all(b == {"name": service["metadata"]["name"], "port": {"name": "http"}} for b in backends)
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"][0]["secretName"] == "ballast-tls"


def test_hpa_scales_the_api_and_owns_its_replicas(ci_render: Rendered, default_render: Rendered) -> None:
    hpa = ci_render.one("HorizontalPodAutoscaler")
    api = ci_render.deployment("api")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": api["metadata"]["name"]}
    assert "replicas" not in api["spec"]  # else every upgrade would reset what the HPA chose
    assert default_render.deployment("api")["spec"]["replicas"] == 2
    assert default_render.all("HorizontalPodAutoscaler") == []
    # CPU utilisation needs a CPU request
    assert container(api)["resources"]["requests"]["cpu"]


def test_scheduler_replicas_from_values(ci_render: Rendered) -> None:
    assert ci_render.deployment("scheduler")["spec"]["replicas"] == ci_values()["scheduler"]["replicas"] == 2


# ----------------------------------------------------------------------------------------------- security
@pytest.mark.parametrize("values", ["default", "ci"])
def test_every_pod_runs_as_non_root(values: str, default_render: Rendered, ci_render: Rendered) -> None:
    r = default_render if values == "default" else ci_render
    specs = [pod_spec(w) for w in _ballast_pods(r).values()] + ray_pod_specs(r.raycluster())
    assert len(specs) == 5
    for spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 1000
        for c in spec["containers"]:
            assert c["securityContext"]["runAsNonRoot"] is True
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_ballast_containers_have_read_only_root_and_writable_emptydirs(default_render: Rendered) -> None:
    for name, w in _ballast_pods(default_render).items():
        c = container(w)
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        volumes = {v["name"]: v for v in pod_spec(w)["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        home = env_of(c)["BALLAST_HOME"]["value"]
        # BALLAST_HOME and /tmp lie on emptyDir volumes
        for path in (home, "/tmp"):
            owner = max((p for p in mounts if path == p or path.startswith(p.rstrip("/") + "/")), key=len)
            assert "emptyDir" in volumes[mounts[owner]], (name, path)


def test_only_the_ray_head_may_use_the_kubernetes_api(default_render: Rendered) -> None:
    # the autoscaler sidecar on the head talks to the API server; Ballast's own pods never do
    for w in _ballast_pods(default_render).values():
        assert pod_spec(w)["automountServiceAccountToken"] is False


# ----------------------------------------------------------------------------------------- migration hook
def test_migrations_run_as_a_pre_install_and_pre_upgrade_hook(default_render: Rendered) -> None:
    job = default_render.job()
    annotations = job["metadata"]["annotations"]
    assert set(annotations["helm.sh/hook"].split(",")) == {"pre-install", "pre-upgrade"}
    assert "before-hook-creation" in annotations["helm.sh/hook-delete-policy"].split(",")
    assert container(job)["command"] == ["ballast", "db", "upgrade"]
    assert pod_spec(job)["restartPolicy"] == "Never"


def test_migration_hook_uses_nothing_the_release_creates(default_render: Rendered, ci_render: Rendered) -> None:
    """A pre-install hook runs before the release's other resources exist: a ServiceAccount, Secret, ConfigMap or
    claim of the chart referenced by the Job would make the first install hang."""
    for r in (default_render, ci_render):
        job = r.job()
        created = {
            d["metadata"]["name"]
            for d in r.docs
            if d is not job and "helm.sh/hook" not in (d["metadata"].get("annotations") or {})
        }
        spec = pod_spec(job)
        referenced = {spec.get("serviceAccountName", "default")}
        referenced |= {v.get("persistentVolumeClaim", {}).get("claimName") for v in spec.get("volumes", [])}
        referenced |= {v.get("configMap", {}).get("name") for v in spec.get("volumes", [])}
        for e in container(job).get("env", []):
            referenced |= {ref.get("name") for ref in (e.get("valueFrom") or {}).values()}
        assert not (referenced - {None}) & created


def test_migrations_can_be_switched_off(render: Renderer) -> None:
    assert render({"migrations": {"enabled": False}}).all("Job") == []


# -------------------------------------------------------------------------------------------- checkpoints
def test_default_checkpoints_on_one_shared_claim(default_render: Rendered) -> None:
    pvc = default_render.one("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    scheduler = default_render.deployment("scheduler")
    root = env_of(container(scheduler))["BALLAST_CHECKPOINT_ROOT"]["value"]
    # mounted on every Ray pod: declared shared, so a multi-node cluster accepts the local path
    assert env_of(container(scheduler))["BALLAST_CHECKPOINT_ROOT_SHARED"]["value"] == "true"
    specs = [pod_spec(scheduler)] + ray_pod_specs(default_render.raycluster())
    for spec in specs:
        (vol,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
        assert vol["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
        (mount,) = [m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == vol["name"]]
        assert mount["mountPath"] == root


def test_an_existing_claim_is_used_and_none_created(render: Renderer) -> None:
    r = render({"checkpoints": {"pvc": {"existingClaim": "team-checkpoints"}}})
    assert r.all("PersistentVolumeClaim") == []
    claims = {v["persistentVolumeClaim"]["claimName"] for s in ray_pod_specs(r.raycluster()) for v in s["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims == {"team-checkpoints"}


def test_s3_checkpoints_with_credentials_on_scheduler_and_every_ray_pod(ci_render: Rendered) -> None:
    s3 = ci_values()["checkpoints"]["s3"]
    scheduler = container(ci_render.deployment("scheduler"))
    assert env_of(scheduler)["BALLAST_CHECKPOINT_ROOT"]["value"] == s3["uri"]
    assert ci_render.all("PersistentVolumeClaim") == []
    ray_containers = [c for spec in ray_pod_specs(ci_render.raycluster()) for c in spec["containers"]]
    for c in [scheduler, *ray_containers]:
        env = env_of(c)
        assert secret_ref(env["AWS_ACCESS_KEY_ID"]) == (s3["existingSecret"], "AWS_ACCESS_KEY_ID")
        assert secret_ref(env["AWS_SECRET_ACCESS_KEY"]) == (s3["existingSecret"], "AWS_SECRET_ACCESS_KEY")
        assert env["AWS_ENDPOINT_URL_S3"]["value"] == s3["endpointUrl"]
        assert env["AWS_DEFAULT_REGION"]["value"] == s3["region"]
        assert all(m["name"] != "checkpoints" for m in c["volumeMounts"])


def test_s3_without_keys_leaves_credentials_to_the_sdk(render: Renderer) -> None:
    r = render({"checkpoints": {"storage": "s3", "s3": {"uri": "s3://b/p"}}})
    env = env_of(container(r.deployment("scheduler")))
    assert env["BALLAST_CHECKPOINT_ROOT"]["value"] == "s3://b/p"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3"} & env.keys()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"checkpoints": {"storage": "s3"}}, "checkpoints.s3.uri is required"),
        ({"checkpoints": {"storage": "gcs"}}, "checkpoints.storage must be pvc or s3"),
    ],
)
def test_bad_checkpoint_storage_is_refused(render: Renderer, values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError, match=message):
        render(values)


# ---------------------------------------------------------------------------------------------- settings
def test_config_becomes_ballast_settings_on_api_and_scheduler(ci_render: Rendered, default_render: Rendered) -> None:
    for component in BALLAST_WORKLOADS:
        env = env_of(container(ci_render.deployment(component)))
        assert env["BALLAST_MAX_CONCURRENT_RUNS"]["value"] == "4"
        assert env["BALLAST_STANDBY_WORKER_GROUPS"]["value"] == "1"
        assert env["BALLAST_ALLOWED_IMPORT_MODULES"]["value"] == "mylab.models,mylab.data"
        # unset config keys stay unset: the code's defaults apply
        assert "BALLAST_SCHEDULER_POLL_SECONDS" not in env
        assert "BALLAST_MAX_CONCURRENT_RUNS" not in env_of(container(default_render.deployment(component)))


def test_extra_env_is_appended(render: Renderer) -> None:
    extra = [{"name": "LOG_FORMAT", "value": "json"}]
    r = render({"api": {"extraEnv": extra}, "scheduler": {"extraEnv": extra}, "rayCluster": {"extraEnv": extra}})
    for c in [container(r.deployment(x)) for x in BALLAST_WORKLOADS] + [
        s["containers"][0] for s in ray_pod_specs(r.raycluster())
    ]:
        assert env_of(c)["LOG_FORMAT"]["value"] == "json"


# ------------------------------------------------------------------------------------------------ metrics
def test_servicemonitor_scrapes_the_api_services_metrics_port(ci_render: Rendered) -> None:
    monitor = ci_render.one("ServiceMonitor")
    service = ci_render.one("Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_grafana_dashboard_configmap_is_labelled_for_the_sidecar(ci_render: Rendered, render: Renderer) -> None:
    cm = ci_render.one("ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    dashboard = json.loads(cm["data"]["ballast.json"])
    assert dashboard["uid"] == "ballast-overview" and dashboard["panels"]
    moved = render(deep_merge(ci_values(), {"metrics": {"grafanaDashboard": {"namespace": "monitoring"}}}))
    assert moved.one("ConfigMap")["metadata"]["namespace"] == "monitoring"


def test_rendering_is_deterministic(render: Renderer) -> None:
    assert render(ci_values()).files == render(ci_values()).files
    assert render().files == render().files
