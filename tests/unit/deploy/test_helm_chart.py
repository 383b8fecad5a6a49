"""The Helm chart (deploy/helm/loopwatch): `helm lint`, `helm template` with the defaults and
with every optional part on, every rendered manifest against the OpenAPI schemas of a pinned
Kubernetes version (kubernetes-validate ships them: nothing is downloaded), the rendered
PrometheusRule through promtool (check and the repository's rule unit tests), the grace
period against the worker's stop bound, and the values the chart refuses.

helm comes from scripts/install-helm.sh (run by scripts/install-tools.sh and CI); without it
these tests fail, naming that script."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.paths import REPO

CHART = REPO / "deploy" / "helm" / "loopwatch"
RULES = REPO / "alerts" / "rules" / "loopwatch.rules.yml"
RULE_TESTS = REPO / "alerts" / "rules" / "loopwatch.rules.test.yml"
DASHBOARD = REPO / "alerts" / "grafana" / "dashboards" / "loopwatch.json"
KUBERNETES = "1.33.0"  # the pinned Kubernetes version the manifests are validated against
ALL_PARTS = [
    "prometheusRule.enabled=true",
    "serviceMonitor.enabled=true",
    "dashboard.enabled=true",
    "keda.enabled=true",
]
CUSTOM_KINDS = {"PrometheusRule", "ServiceMonitor", "ScaledObject"}  # CRDs: no core schema


def helm() -> str:
    found = shutil.which("helm")
    assert found, (
        "helm is not installed: run scripts/install-helm.sh (scripts/install-tools.sh does)"
    )
    return found


def render(*sets: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = [helm(), "template", "lw", str(CHART), "--namespace", "agents"]
    for s in sets:
        argv += ["--set", s]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def manifests(*sets: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render(*sets).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def env_of(statefulset: dict[str, Any]) -> dict[str, Any]:
    [container] = statefulset["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_charts_copies_of_the_rules_and_dashboard_are_the_repositorys() -> None:
    for original, copy in (
        (RULES, CHART / "files" / "loopwatch.rules.yml"),
        (DASHBOARD, CHART / "files" / "loopwatch.json"),
    ):
        assert copy.read_bytes() == original.read_bytes(), (
            f"{copy} differs from {original}: run scripts/sync-chart.sh"
        )


def test_the_alertmanager_values_snippet_is_the_repositorys_routing() -> None:
    snippet = yaml.safe_load((REPO / "deploy" / "helm" / "alertmanager-values.yaml").read_text())
    shipped = yaml.safe_load((REPO / "alerts" / "alertmanager" / "alertmanager.yml").read_text())
    assert snippet == {"alertmanager": {"config": shipped}}, "run scripts/sync-chart.sh"


def test_helm_lint_is_clean() -> None:
    for sets in ([], ALL_PARTS):
        argv = [helm(), "lint", str(CHART)]
        for s in sets:
            argv += ["--set", s]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.parametrize("sets", [[], ALL_PARTS], ids=["defaults", "every-part"])
def test_every_manifest_is_valid_kubernetes(sets: list[str]) -> None:
    docs = manifests(*sets)
    kinds = {d["kind"] for d in docs}
    want = {"StatefulSet", "Service", "ConfigMap", "Secret", "PodDisruptionBudget"}
    assert want <= kinds
    if sets:
        assert kinds >= CUSTOM_KINDS
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            assert doc["apiVersion"] in {"monitoring.coreos.com/v1", "keda.sh/v1alpha1"}
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_statefulset_keeps_state_probes_and_stops_within_its_grace() -> None:
    [sts] = by_kind(manifests(), "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = env_of(sts)
    # the rocksdb state on a volume claim, mounted where the worker keeps it
    [claim] = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env["LOOPWATCH_DATA_DIR"]
    assert env["LOOPWATCH_STORE"] == "rocksdb://"
    # liveness is the event loop, readiness the broker and partitions
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # the pod is never killed inside the worker's bounded stop
    assert pod["terminationGracePeriodSeconds"] > float(env["LOOPWATCH_STOP_TIMEOUT_SECONDS"])
    # secrets from a Secret, never inline; non-root, read-only root filesystem
    assert env["LOOPWATCH_FINGERPRINT_KEY"]["secretKeyRef"]["key"] == "fingerprint-key"
    assert env["LOOPWATCH_API_TOKEN"]["secretKeyRef"]["key"] == "api-token"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # each worker is reachable by the others at its headless-service name
    assert "-headless." in env["LOOPWATCH_WEB_URL"]


def test_a_policy_change_rolls_the_pods() -> None:
    def checksum(*sets: str) -> str:
        [sts] = by_kind(manifests(*sets), "StatefulSet")
        return str(sts["spec"]["template"]["metadata"]["annotations"]["checksum/policy"])

    assert checksum() != checksum("policy=policy_version: v2\n")
    [cm] = [d for d in manifests() if d["metadata"]["name"].endswith("-policy")]
    assert "policy_version" in cm["data"]["policy.yaml"]


def test_an_existing_secret_is_used_not_created() -> None:
    docs = manifests("secret.existingSecret=loopwatch-keys")
    assert by_kind(docs, "Secret") == []
    [sts] = by_kind(docs, "StatefulSet")
    ref = env_of(sts)["LOOPWATCH_API_TOKEN"]["secretKeyRef"]
    assert ref["name"] == "loopwatch-keys"


def test_the_prometheus_rule_is_the_repositorys_rule_file_and_passes_promtool(
    tmp_path: Path,
) -> None:
    [rule] = by_kind(manifests(*ALL_PARTS), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    rendered = tmp_path / "loopwatch.rules.yml"
    rendered.write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed: run scripts/install-tools.sh"
    done = subprocess.run(
        [promtool, "check", "rules", str(rendered)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)  # its rule_files: loopwatch.rules.yml
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_configmap_carries_the_sidecars_label_and_the_dashboard() -> None:
    docs = manifests("dashboard.enabled=true")
    [cm] = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["loopwatch.json"].strip() == DASHBOARD.read_text().strip()


def test_monitoring_and_scaling_point_at_the_worker() -> None:
    docs = manifests(*ALL_PARTS)
    [monitor] = by_kind(docs, "ServiceMonitor")
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics"
    assert {"targetLabel": "job", "replacement": "loopwatch"} in endpoint["relabelings"]
    [scaled] = by_kind(docs, "ScaledObject")
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "kafka" and trigger["metadata"]["topic"] == "otlp_spans"
    assert scaled["spec"]["maxReplicaCount"] <= 8  # kafka.partitions
    [sts] = by_kind(docs, "StatefulSet")
    assert "replicas" not in sts["spec"]  # KEDA owns the count


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["replicas=9"], "replicas (9) > kafka.partitions (8)"),
        (["keda.enabled=true", "keda.maxReplicas=12"], "keda.maxReplicas (12) > kafka.partitions"),
        (["kafka.bootstrap="], "kafka"),
        (["kafka.encoding=xml"], "otlp_proto"),
        (["replicas=0"], "replicas"),
        (["probes.liveness.path=/"], "probes"),
    ],
)
def test_values_the_chart_refuses_say_why(sets: list[str], message: str) -> None:
    done = render(*sets, check=False)
    assert done.returncode != 0 and message in done.stderr, done.stderr
