"""docker-compose.yml and the deploy/ configs it mounts, without a Docker engine.

`docker-compose config -q` (Debian package docker-compose, installed by
scripts/install-tools.sh) validates the file against the Compose schema; the other tests
check what the schema cannot: every mounted path exists, ports and images are sane, and
the services agree with each other (scrape target = metrics port, rule glob = rule files,
Grafana datasource = Prometheus service, collector = contracts §1).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yml"

SERVICES = {"kafka", "otel-collector", "loopwatch", "prometheus", "alertmanager", "grafana"}
IMAGES = {
    "kafka": "apache/kafka",
    "otel-collector": "otel/opentelemetry-collector-contrib",
    "prometheus": "prom/prometheus",
    "alertmanager": "prom/alertmanager",
    "grafana": "grafana/grafana",
}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and isinstance(doc.get("services"), dict)
    return doc


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    return compose["services"][name]  # type: ignore[no-any-return]


def bind_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(host path, container path) for the ./relative bind mounts of a service."""
    out = []
    for vol in svc.get("volumes", []):
        assert isinstance(vol, str), f"long volume syntax not expected: {vol!r}"
        parts = vol.split(":")
        if parts[0].startswith((".", "/")):
            out.append((parts[0], parts[1]))
    return out


def mount_target(svc: dict[str, Any], host: str) -> str:
    for src, dst in bind_mounts(svc):
        if (REPO / src).resolve() == (REPO / host).resolve():
            return dst
    raise AssertionError(f"{host} is not mounted")


def host_path(svc: dict[str, Any], container_path: str) -> Path:
    """The repo file behind a container path, through the service's bind mounts."""
    for src, dst in bind_mounts(svc):
        if container_path == dst or container_path.startswith(dst.rstrip("/") + "/"):
            return (REPO / src / container_path[len(dst) :].lstrip("/")).resolve()
    raise AssertionError(f"{container_path} is not inside any bind mount")


def test_docker_compose_config_validates() -> None:
    exe = shutil.which("docker-compose")
    if exe:
        cmd = [exe, "-f", str(COMPOSE), "config", "-q"]
    elif shutil.which("docker"):
        cmd = ["docker", "compose", "-f", str(COMPOSE), "config", "-q"]
    else:
        pytest.fail(
            "docker-compose not found: run scripts/install-tools.sh "
            "(Debian package docker-compose, installed with --no-install-recommends)"
        )
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr


def test_services_and_images(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == SERVICES
    for name, svc in compose["services"].items():
        if name == "loopwatch":
            assert svc["build"]["context"] == "."
            assert (REPO / svc["build"].get("dockerfile", "Dockerfile")).is_file()
            continue
        image = svc["image"]
        repo, _, tag = image.partition(":")
        assert repo == IMAGES[name], image
        assert tag and tag != "latest", f"{name}: pin the image tag ({image})"


def test_every_bind_mount_exists(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith((".", "/")):
                assert (REPO / src).exists(), f"{name}: {src} does not exist"
            else:
                assert src in declared, f"{name}: named volume {src} is not declared"


def test_ports_are_valid_and_unique(compose: dict[str, Any]) -> None:
    seen: dict[int, str] = {}
    for name, svc in compose["services"].items():
        for spec in svc.get("ports", []):
            m = re.fullmatch(r"(?:(\d+\.\d+\.\d+\.\d+):)?(\d+):(\d+)(?:/(tcp|udp))?", str(spec))
            assert m, f"{name}: bad port spec {spec!r}"
            host, container = int(m.group(2)), int(m.group(3))
            assert 0 < host < 65536 and 0 < container < 65536
            assert host not in seen, f"host port {host} used by {seen[host]} and {name}"
            seen[host] = name
    assert {6066, 9464, 4317, 4318, 9090, 9093, 3000} <= set(seen)


def test_worker_service(compose: dict[str, Any]) -> None:
    svc = service(compose, "loopwatch")
    env = svc["environment"]
    assert env["LOOPWATCH_BOOTSTRAP"] == "kafka:9092"
    assert env["LOOPWATCH_METRICS_PORT"] == "9464"
    assert host_path(svc, env["LOOPWATCH_CONFIG"]).is_file()
    ports = {p.split(":")[-1] for p in svc["ports"]}
    assert {"6066", "9464"} <= ports
    assert svc["depends_on"]["kafka"]["condition"] == "service_healthy"

    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"^RUN pip install \.", dockerfile, re.M)
    # the native span path: built in a builder stage, installed and checked in the image
    assert re.search(r"^FROM python:3\.11-slim AS native$", dockerfile, re.M)
    assert re.search(r"^COPY native/src \./src$", dockerfile, re.M)
    assert "COPY --from=native /wheels /wheels" in dockerfile
    assert "native.ACTIVE == 'native'" in dockerfile
    assert 'ENTRYPOINT ["loopwatch"]' in dockerfile and 'CMD ["worker"]' in dockerfile
    # everything the package needs is copied into the image
    for pkg in ("detectors", "streams", "alerts"):
        assert re.search(rf"^COPY {pkg} ", dockerfile, re.M), pkg
        assert (REPO / pkg / "__init__.py").is_file()


def test_kafka_service(compose: dict[str, Any]) -> None:
    env = service(compose, "kafka")["environment"]
    assert "controller" in env["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == "1@kafka:9093"


def test_collector_config_matches_the_input_contract(compose: dict[str, Any]) -> None:
    svc = service(compose, "otel-collector")
    config_arg = next(a for a in svc["command"] if a.startswith("--config="))
    cfg = yaml.safe_load(host_path(svc, config_arg.split("=", 1)[1]).read_text())
    assert set(cfg["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    kafka = cfg["exporters"]["kafka"]
    assert kafka["brokers"] == ["kafka:9092"]
    assert kafka["traces"] == {"topic": "otlp_spans", "encoding": "otlp_proto"}
    assert kafka["partition_traces_by_id"] is True
    # removed upstream (deprecated in v0.124): per-signal keys only
    assert "topic" not in kafka and "encoding" not in kafka
    pipe = cfg["service"]["pipelines"]["traces"]
    assert pipe["receivers"] == ["otlp"] and pipe["exporters"] == ["kafka"]
    assert set(pipe["processors"]) <= set(cfg["processors"])


def test_prometheus_config_scrapes_worker_and_loads_rules(compose: dict[str, Any]) -> None:
    svc = service(compose, "prometheus")
    config_arg = next(a for a in svc["command"] if a.startswith("--config.file="))
    prom = yaml.safe_load(host_path(svc, config_arg.split("=", 1)[1]).read_text())

    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = [t for sc in jobs["loopwatch"]["static_configs"] for t in sc["targets"]]
    port = service(compose, "loopwatch")["environment"]["LOOPWATCH_METRICS_PORT"]
    assert targets == [f"loopwatch:{port}"]
    assert jobs["loopwatch"].get("metrics_path", "/metrics") == "/metrics"

    (rule_glob,) = prom["rule_files"]
    rules_dir = host_path(svc, str(Path(rule_glob).parent))
    loaded = sorted(p.name for p in rules_dir.iterdir() if fnmatch.fnmatch(p.name, "*.rules.yml"))
    assert Path(rule_glob).name == "*.rules.yml"
    assert loaded == ["loopwatch.rules.yml"]  # never the promtool test file

    am_targets = [t for c in prom["alerting"]["alertmanagers"] for s in c["static_configs"]
                  for t in s["targets"]]  # fmt: skip
    assert am_targets == ["alertmanager:9093"]


@pytest.mark.prometheus
def test_promtool_check_config_of_the_compose_prometheus(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.fail("promtool not found: run scripts/install-tools.sh (Debian package prometheus)")
    prom = yaml.safe_load((REPO / "deploy" / "prometheus.yml").read_text())
    prom["rule_files"] = [str(REPO / "alerts" / "rules" / "*.rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prom))
    res = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS: 1 rule files found" in res.stdout + res.stderr


def test_alertmanager_service_uses_the_repo_config(compose: dict[str, Any]) -> None:
    svc = service(compose, "alertmanager")
    config_arg = next(a for a in svc["command"] if a.startswith("--config.file="))
    assert host_path(svc, config_arg.split("=", 1)[1]) == (
        REPO / "alerts" / "alertmanager" / "alertmanager.yml"
    )


def test_grafana_provisioning_is_wired(compose: dict[str, Any]) -> None:
    svc = service(compose, "grafana")
    prov = host_path(svc, "/etc/grafana/provisioning")
    assert prov == (REPO / "alerts" / "grafana" / "provisioning")

    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())["datasources"]
    prom_ds = next(d for d in ds if d["type"] == "prometheus")
    assert prom_ds["url"] == "http://prometheus:9090"
    assert "9090:9090" in service(compose, "prometheus")["ports"]

    providers = yaml.safe_load((prov / "dashboards" / "dashboards.yml").read_text())["providers"]
    (provider,) = providers
    dash_dir = host_path(svc, provider["options"]["path"])
    assert dash_dir == (REPO / "alerts" / "grafana" / "dashboards")
    dashboards = list(dash_dir.glob("*.json"))
    assert dashboards
    for path in dashboards:
        dash = json.loads(path.read_text())
        uids = {t["datasource"]["uid"] for p in dash["panels"] for t in p.get("targets", [])} | {
            p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p
        }
        assert uids == {prom_ds["uid"]}, path.name
    home = svc["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(svc, home).is_file()
