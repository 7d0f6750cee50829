"""docker/k8s/: every manifest validates against the Kubernetes API's JSON schemas (kubernetes-validate, offline,
strict: an unknown or misspelled field fails), and holds the invariants the service needs: one GPU per pod,
probes on the right routes, a grace period above shutdown_timeout_s, a /dev/shm that fits the workers' arenas, the
API key from a mounted Secret, the replica name from the pod's name, no service-link variables in any pod, a proxy
that resolves the replicas by their fully qualified name."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from convserve.service.cluster.supervisor import GONE_S, KILL_JOIN_S, stop_budgets
from convserve.service.config import Settings

K8S = Path(__file__).resolve().parents[1] / "docker" / "k8s"
#: the Kubernetes version the schemas are taken from (kubernetes-validate ships them; no cluster, no download)
VERSION = "1.30.0"


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        out.extend((path.name, d) for d in yaml.safe_load_all(path.read_text()) if d)
    return out


def by_kind(kind: str) -> dict:
    (doc,) = [d for _, d in documents() if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else v.get("kind"))
def test_every_manifest_validates_against_the_kubernetes_schemas(name, doc):
    kubernetes_validate.validate(doc, VERSION, strict=True)


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(k["resources"]) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def env_of(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_statefulset_serves_one_gpu_per_stable_pod_with_its_probes_and_graceful_stop():
    sts = by_kind("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = env_of(c)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sts["spec"]["serviceName"] == "convserve-headless"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/readyz"
    # every CONVSERVE_ variable is a setting, and a valid value of it
    settings = {k[len("CONVSERVE_"):].lower(): v for k, v in env.items()
                if k.startswith("CONVSERVE_") and isinstance(v, str) and k != "CONVSERVE_API_KEY_FILE"}
    assert set(settings) <= set(Settings.model_fields)
    s = Settings(**settings)
    # the start gives up (exit 1, one line naming the engines) before the kubelet would kill it unexplained
    assert start["periodSeconds"] * start["failureThreshold"] > s.engine_build_timeout_s + 30
    pre_stop = 5
    # the kubelet's SIGKILL comes after the grace period: the workers' and then the engines' drains and the
    # final snapshot must fit in it, each stage's whole budget used, and a stage's child killed at its end
    kill = len(stop_budgets(s)) * (KILL_JOIN_S + GONE_S)
    assert pod["terminationGracePeriodSeconds"] > pre_stop + sum(stop_budgets(s)) + kill
    assert env["CONVSERVE_REPLICA_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # the key is a file of the mounted Secret, never a plain env value
    assert "CONVSERVE_API_KEY" not in env
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert env["CONVSERVE_API_KEY_FILE"].startswith(mounts["api-key"] + "/")
    assert volumes["api-key"]["secret"]["secretName"] == "convserve-api-key"
    # /dev/shm in memory, at least workers x shm_bytes
    assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    size = volumes["dshm"]["emptyDir"]["sizeLimit"]
    assert size.endswith("Mi") and int(size[:-2]) << 20 >= s.workers * s.shm_bytes
    # the snapshot volume, a claim per pod
    assert mounts["state"] == "/var/lib/convserve" == str(s.state_dir)
    assert [t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]] == ["state"]
    ann = sts["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/path"] == "/metrics"


def test_services_pdb_and_proxy_select_what_they_should():
    sts = by_kind("StatefulSet")
    pods = sts["spec"]["template"]["metadata"]["labels"]
    services = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "Service"}
    assert services["convserve-headless"]["spec"]["clusterIP"] == "None"
    assert services["convserve-headless"]["spec"]["selector"].items() <= pods.items()
    proxy = by_kind("Deployment")
    assert services["convserve"]["spec"]["type"] == "ClusterIP"
    assert services["convserve"]["spec"]["selector"].items() <= proxy["spec"]["template"]["metadata"]["labels"].items()
    pdbs = {d["metadata"]["name"]: d for _, d in documents() if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {"convserve", "convserve-proxy"}
    for name, selected in (("convserve", pods), ("convserve-proxy", proxy["spec"]["template"]["metadata"]["labels"])):
        pdb = pdbs[name]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= selected.items() and pdb["spec"]["maxUnavailable"] == 1
    # the replicas' PDB does not also select the proxy's pods (nor the other way round)
    assert not pdbs["convserve"]["spec"]["selector"]["matchLabels"].items() <= \
        proxy["spec"]["template"]["metadata"]["labels"].items()
    for _, template in pod_templates():
        # the "restricted" Pod Security Standard, which namespaces may enforce
        assert template["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        for c in template["spec"]["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"], c["name"]


def _bytes(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(q[:-2]) * units[q[-2:]] if q[-2:] in units else int(q)


def test_a_snapshot_of_every_slot_fits_the_memory_limit_snapshot_keep_plus_one_the_volume_and_the_timeout():
    # the final snapshot passes through host memory whole: a pool sized by the GPU (slots=auto) would not
    sts = by_kind("StatefulSet")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    env = env_of(c)
    s = Settings(**{k[len("CONVSERVE_"):].lower(): v for k, v in env.items()
                    if k.startswith("CONVSERVE_") and isinstance(v, str) and k != "CONVSERVE_API_KEY_FILE"})
    assert isinstance(s.slots, int), "a fixed slots value: auto follows the GPU, not the pod's memory"
    layers = s.layers if isinstance(s.layers, int) else len(s.layers)
    per_session = layers * s.dim * (s.width - 1) * 2       # the default model's state, bf16 on the GPU
    snapshot = s.slots * per_session
    memory = _bytes(c["resources"]["limits"]["memory"])
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    shm = _bytes(volumes["dshm"]["emptyDir"]["sizeLimit"])
    assert snapshot + shm <= memory // 2
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    # the newest file is written before the oldest is removed: snapshot_keep + 1 at the peak
    assert (s.snapshot_keep + 1) * snapshot <= _bytes(claim["spec"]["resources"]["requests"]["storage"])
    # the final snapshot of a full pool is written within snapshot_timeout_s at 70 MB/s or less
    assert snapshot / s.snapshot_timeout_s <= 70e6


def pod_templates() -> list[tuple[str, dict]]:
    """Every pod template of the manifests (workloads' spec.template, a CronJob's jobTemplate), by kind/name."""
    out = []
    for _, d in documents():
        spec = d.get("spec", {})
        if "jobTemplate" in spec:
            spec = spec["jobTemplate"]["spec"]
        if "template" in spec:
            out.append((f"{d['kind']}/{d['metadata']['name']}", spec["template"]))
    return out


def test_no_pod_gets_service_link_variables():
    # the Service `convserve` would give every pod of the namespace CONVSERVE_SERVICE_HOST, CONVSERVE_PORT=tcp://...,
    # CONVSERVE_PORT_8000_TCP... (Docker-link-style variables), which the settings loader takes for settings
    templates = pod_templates()
    assert {"StatefulSet/convserve", "Deployment/convserve-proxy"} <= {name for name, _ in templates}
    for name, template in templates:
        assert template["spec"].get("enableServiceLinks") is False, name


def test_the_proxy_resolves_the_replicas_by_their_fully_qualified_name():
    # HAProxy's resolvers do not apply resolv.conf's search domains (parse-resolv-conf takes only the nameservers):
    # a bare "convserve-headless" is asked as it is, and cluster DNS answers NXDOMAIN
    cfg = by_kind("ConfigMap")["data"]["haproxy.cfg"]
    lines = [ln.strip() for ln in cfg.splitlines()]
    assert "default-server check resolvers cluster init-addr none" in lines
    servers = [ln for ln in lines if ln.startswith("server")]
    assert len(servers) == 16
    # one per StatefulSet pod by its stable name, with a fixed id (consistent hashing places servers by id, so
    # every proxy replica, and a restarted pod, keeps a session on one pod); double-quoted: HAProxy expands
    # variables only there
    sts = by_kind("StatefulSet")
    assert sts["spec"]["replicas"] <= len(servers)
    svc = sts["spec"]["serviceName"]
    for i, line in enumerate(servers):
        assert line == (f'server {sts["metadata"]["name"]}-{i} "{sts["metadata"]["name"]}-{i}.{svc}'
                        f'.${{POD_NAMESPACE}}.svc.${{CLUSTER_DOMAIN}}:8000" id {i + 1}'), line
    (c,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    env = env_of(c)
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["CLUSTER_DOMAIN"] == "cluster.local"
    # every variable the configuration uses is set in the container
    assert set(re.findall(r"\$\{(\w+)", cfg)) <= set(env)


def test_the_proxy_configuration_is_valid_haproxy_that_hashes_the_session_header(tmp_path):
    cfg = by_kind("ConfigMap")["data"]["haproxy.cfg"]
    assert "balance hdr(X-Session-Id)" in cfg and "hash-type consistent" in cfg
    haproxy = shutil.which("haproxy", path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if haproxy is None:
        pytest.skip("haproxy is not installed (apt-get install haproxy; .ci/run does it): syntax not checked")
    (tmp_path / "haproxy.cfg").write_text(cfg)
    # the container's environment, the downward API's namespace as a kubelet would fill it
    (c,) = by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    env = {k: v if isinstance(v, str) else "ns" for k, v in env_of(c).items()}
    r = subprocess.run([haproxy, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True, text=True,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
