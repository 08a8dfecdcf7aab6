"""Deploy artifacts (deploy/): compose file, Dockerfile, Prometheus, Grafana, systemd, example config.

Fast and offline. Nothing here starts a container (no Docker engine on the build machines): the
files are parsed and checked against the code they configure. The compose environment and the
example TOML go through the real ``aggregator.service.config.load_config``; every metric name in the
Grafana dashboard must be in the exposition of a real ``aggregator.service.metrics.Metrics`` registry.
Where the tools exist, ``promtool``, ``systemd-analyze verify`` and ``docker compose config`` check
the files too; each of those tests skips with the reason when its tool is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml  # pyyaml: in the test extra

from aggregator.service.config import DEFAULTS, load_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
PROMETHEUS_YML = DEPLOY / "prometheus" / "prometheus.yml"
DATASOURCE_YML = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARDS_YML = DEPLOY / "grafana" / "provisioning" / "dashboards" / "panagg.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "panagg.json"
UNIT = DEPLOY / "systemd" / "panagg.service"
EXAMPLE_TOML = DEPLOY / "panagg.example.toml"
DOCKERFILE = DEPLOY / "Dockerfile"

AGGREGATORS = ["aggregator-1", "aggregator-2", "aggregator-3"]
REQUIRED_SERVICES = {"kafka", *AGGREGATORS, "prometheus", "grafana"}
# labels Prometheus adds to every scraped series
TARGET_LABELS = {"instance", "job"}


# -- helpers ---------------------------------------------------------------------------------------
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def _interpolate(value):
    """Compose variable interpolation with every variable unset: ``${X:-default}`` -> default."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if not isinstance(value, str):
        return value
    out = _VAR.sub(lambda m: m.group(2) or "", value.replace("$$", "\0"))
    assert "$" not in out, f"unsupported interpolation in {value!r}: use ${{VAR:-default}}"
    return out.replace("\0", "$")


@pytest.fixture(scope="module")
def compose_raw():
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(compose_raw):
    return _interpolate(compose_raw)


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    # compose passes every value as a string; YAML may have parsed numbers or booleans
    return {k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
            for k, v in env.items()}


def _ports(service: dict) -> list[tuple[str | None, str, str]]:
    """(host_ip, host_port, container_port) of every published port, short or long syntax."""
    out = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            out.append((port.get("host_ip"), str(port.get("published", "")),
                        str(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
        elif len(parts) == 2:
            out.append((None, parts[0], parts[1]))
        else:
            out.append((None, "", parts[0]))
    return out


def _mounts(service: dict) -> list[tuple[str, str]]:
    out = []
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            out.append((str(vol.get("source", "")), str(vol["target"])))
        else:
            source, target = str(vol).split(":")[:2]
            out.append((source, target))
    return out


def _agg_config(compose: dict, name: str) -> dict:
    return load_config(None, env=_env(compose["services"][name]))


# -- docker-compose.yml ----------------------------------------------------------------------------
def test_compose_has_the_services(compose):
    services = set(compose["services"])
    assert REQUIRED_SERVICES <= services, f"missing services: {REQUIRED_SERVICES - services}"


def test_images_are_pinned(compose):
    pinned = {"kafka": "apache/kafka:3.9.1"}
    for name, svc in compose["services"].items():
        image = svc.get("image")
        if image is None:
            assert "build" in svc, f"{name}: neither image nor build"
            continue
        repo, sep, tag = image.rpartition(":")
        assert sep and "/" not in tag and tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest", f"{name}: image {image!r} uses :latest"
        if name in pinned:
            assert image == pinned[name]
    assert compose["services"]["prometheus"]["image"].startswith("prom/prometheus:v")
    assert compose["services"]["grafana"]["image"].startswith("grafana/grafana:")


def test_every_published_port_is_loopback_only(compose):
    seen = set()
    for name, svc in compose["services"].items():
        assert svc.get("network_mode") != "host", f"{name}: host networking bypasses port binding"
        for host_ip, host_port, _ in _ports(svc):
            assert host_ip == "127.0.0.1", f"{name}: port {host_port} is not bound to 127.0.0.1"
            assert host_port, f"{name}: publish an explicit host port"
            assert host_port not in seen, f"{name}: host port {host_port} published twice"
            seen.add(host_port)


def test_bind_mounts_and_build_context_exist(compose):
    for name, svc in compose["services"].items():
        for source, _ in _mounts(svc):
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: bind mount source {source} missing"
            else:
                assert source in (compose.get("volumes") or {}), f"{name}: volume {source} undeclared"
        build = svc.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context should be the repository root"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_kafka_is_single_node_kraft_with_healthcheck(compose):
    kafka = compose["services"]["kafka"]
    env = _env(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert env.get("CLUSTER_ID"), "the apache/kafka image needs CLUSTER_ID in KRaft mode"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert "test" in kafka["healthcheck"]
    init = compose["services"]["kafka-init"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_aggregator_environment_is_a_valid_panagg_config(compose):
    known = {f"PANAGG_{s.upper()}_{k.upper()}" for s, keys in DEFAULTS.items() for k in keys}
    configs = {}
    for name in AGGREGATORS:
        svc = compose["services"][name]
        env = _env(svc)
        # load_config ignores unknown variables, so a typo would be silently dropped: refuse it
        unknown = {k for k in env if k.startswith("PANAGG_")} - known - {"PANAGG_AUDIT_KEY"}
        assert not unknown, f"{name}: not configuration keys: {sorted(unknown)}"
        cfg = _agg_config(compose, name)
        configs[name] = cfg
        assert cfg["source"]["kind"] == "kafka"
        assert cfg["source"]["bootstrap"] == "kafka:9092"
        assert cfg["source"]["group"] == "panagg"
        # (scale-out: time windows by the process clock; window.clock = auto cannot choose
        # the records' timestamps there)
        assert cfg["window"]["kind"] == "time"
        assert cfg["metrics"]["host"] == "0.0.0.0"
        assert env["PANAGG_STATE_EPSILON"]
        # the metrics port is the container side of the one published port
        ports = _ports(svc)
        assert [c for _, _, c in ports] == [str(cfg["metrics"]["port"])]
        # scale-out: one state per partition, checkpoints on the volume all members share
        assert cfg["scale"]["partitioned"] is True
        volumes = [(s, t) for s, t in _mounts(svc) if not s.startswith((".", "/"))]
        assert len(volumes) == 1, f"{name}: expected one named volume"
        target = volumes[0][1].rstrip("/") + "/"
        assert cfg["checkpoint"]["dir"].startswith(target)
        assert cfg["release"]["dir"].startswith(target)
        assert svc["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
        assert svc["stop_signal"] == "SIGTERM" and svc.get("stop_grace_period")
    volumes = [_mounts(compose["services"][n])[0][0] for n in AGGREGATORS]
    assert len(set(volumes)) == 1, "partition handover needs one volume shared by all aggregators"
    assert all("profiles" not in compose["services"][n] for n in AGGREGATORS)
    # static membership ids must differ (the derived default is the same in every container)
    ids = [c["source"]["instance_id"] for c in configs.values()]
    assert all(ids) and len(set(ids)) == len(ids), ids
    topics = {c["source"]["topic"] for c in configs.values()}
    assert len(topics) == 1
    init_cmd = compose["services"]["kafka-init"]["command"]
    assert init_cmd[init_cmd.index("--topic") + 1] in topics


def test_dockerfile_is_slim_nonroot_and_runs_panagg():
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    assert froms and all(f == "python:3.11-slim" for f in froms), froms
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    entry = re.findall(r"^ENTRYPOINT\s+(.+)$", text, flags=re.M)
    assert entry, "no ENTRYPOINT"
    argv = json.loads(entry[-1])
    assert Path(argv[0]).name == "panagg" and argv[1:] == ["run"]
    # what the image copies is what pyproject packages
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    top_level = {p.split(".")[0] for p in pyproject["tool"]["setuptools"]["packages"]}
    for package in top_level:
        assert re.search(rf"^COPY\s+{package}/?\s", text, flags=re.M), f"{package} not copied"
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    for package in top_level:
        assert f"!{package}" in ignore


def test_docker_compose_config_validates():
    if shutil.which("docker") is None:
        pytest.skip("docker CLI not installed: compose file checked by parsing only")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed (`docker compose version` fails): "
                    "compose file checked by parsing only")
    res = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


# -- Prometheus ------------------------------------------------------------------------------------
def test_prometheus_scrapes_the_aggregators(compose):
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", [])
               for t in sc["targets"]}
    expected = {f"{n}:{_agg_config(compose, n)['metrics']['port']}" for n in AGGREGATORS}
    assert targets == expected
    mounts = dict((t, s) for s, t in _mounts(compose["services"]["prometheus"]))
    assert (DEPLOY / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_YML


def test_promtool_accepts_prometheus_yml():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    res = subprocess.run(["promtool", "check", "config", "--syntax-only", str(PROMETHEUS_YML)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# -- Grafana ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def _targets(dashboard):
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel, target


def test_grafana_provisioning_matches_compose(compose, dashboard):
    grafana = compose["services"]["grafana"]
    mounts = {t: (DEPLOY / s).resolve() for s, t in _mounts(grafana) if s.startswith(".")}
    assert mounts["/etc/grafana/provisioning"] == DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load(DATASOURCE_YML.read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    assert ds[0]["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    provider = yaml.safe_load(DASHBOARDS_YML.read_text())["providers"][0]
    assert mounts[provider["options"]["path"]] == DASHBOARD.parent
    home = _env(grafana).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert mounts[str(Path(home).parent)] / Path(home).name == DASHBOARD
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    uids |= {t["datasource"]["uid"] for _, t in _targets(dashboard)}
    assert uids == {ds[0]["uid"]}


def test_dashboard_panels_are_well_formed(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(ref_ids) == len(set(ref_ids))


@pytest.fixture(scope="module")
def exposition():
    """{sample name: label names} from a real Metrics() registry, as Prometheus would scrape it."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from aggregator.service.metrics import Metrics

    m = Metrics()
    # labelled children appear once the service sets them; set one like the service does
    m.lag.labels(partition="logins:0").set(0)
    m.release_duration.observe(0.1)
    m.checkpointed(0.01)
    names: dict[str, set[str]] = {}
    text = generate_latest(m.registry).decode()
    for family in text_string_to_metric_families(text):
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
                    "gauge": [""]}.get(family.type, [""])
        for suffix in suffixes:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    assert "panagg_events_total" in names and "le" in names["panagg_release_duration_seconds_bucket"]
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan", "Inf", "NaN"}
_GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def _promql(expr: str) -> str:
    for var, value in _GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def _metric_names(expr: str) -> set[str]:
    e = _STRING.sub('""', _promql(expr))
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = _LABEL_LIST.sub("", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names


def _label_names(expr: str) -> set[str]:
    e = _STRING.sub('""', _promql(expr))
    labels = {x.strip() for group in _LABEL_LIST.findall(e) for x in group.split(",") if x.strip()}
    for block in re.findall(r"\{([^}]*)\}", e):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", block))
    return labels


def test_dashboard_metrics_exist_in_the_real_registry(dashboard, exposition):
    for panel, target in _targets(dashboard):
        expr = target["expr"]
        names = _metric_names(expr)
        assert names, f"{panel['title']}: no metric in {expr!r}"
        unknown = names - set(exposition)
        assert not unknown, (f"{panel['title']}: {sorted(unknown)} not exported by "
                             f"aggregator.service.metrics.Metrics (expression {expr!r})")
        available = TARGET_LABELS.union(*(exposition[n] for n in names))
        assert _label_names(expr) <= available, f"{panel['title']}: unknown label in {expr!r}"
        legend = set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}",
                                target.get("legendFormat", "")))
        assert legend <= available, f"{panel['title']}: legend {legend - available} not a label"


def test_dashboard_covers_the_operational_metrics(dashboard):
    used = set().union(*(_metric_names(t["expr"]) for _, t in _targets(dashboard)))
    wanted = {"panagg_events_total", "panagg_decode_errors_total", "panagg_releases_total",
              "panagg_releases_refused_total", "panagg_last_release_timestamp_seconds",
              "panagg_release_duration_seconds_bucket", "panagg_checkpoint_duration_seconds_bucket",
              "panagg_checkpoint_age_seconds", "panagg_window_progress_ratio",
              "panagg_consumer_lag_records", "panagg_budget_spent_epsilon"}
    assert wanted <= used, f"dashboard lacks {sorted(wanted - used)}"
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    assert "rate(panagg_events_total[1m])" in exprs
    for hist in ("panagg_release_duration_seconds_bucket", "panagg_checkpoint_duration_seconds_bucket"):
        quantiles = {q for e in exprs if hist in e
                     for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)}
        assert {"0.5", "0.99"} <= quantiles, f"{hist}: p50 and p99 wanted, got {quantiles}"


def test_promtool_parses_every_dashboard_expression(dashboard, tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = [{"record": f"dashboard:panel{panel['id']}:{t['refId']}", "expr": _promql(t["expr"])}
             for panel, t in _targets(dashboard)]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


# -- systemd unit and example config ---------------------------------------------------------------
def _unit() -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> values (systemd allows repeated keys, so not configparser)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"bad unit line: {raw!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_systemd_unit_runs_panagg_hardened():
    unit = _unit()
    assert set(unit) == {"Unit", "Service", "Install"}
    svc = {k: v[-1] for k, v in unit["Service"].items()}
    argv = svc["ExecStart"].split()
    assert argv[0] == "/opt/panagg/.venv/bin/panagg" and argv[1] == "run"
    assert argv[argv.index("--config") + 1] == "/etc/panagg/panagg.toml"
    assert svc["User"] == "panagg" and svc["StateDirectory"] == "panagg"
    assert svc["Restart"] == "on-failure"
    assert svc["KillSignal"] == "SIGTERM" and int(svc["TimeoutStopSec"]) >= 30
    assert svc["EnvironmentFile"] == "-/etc/panagg/env"
    assert svc["ProtectSystem"] == "strict"
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp"):
        assert svc[key] == "yes", key
    assert "/var/lib/panagg" in svc["ReadWritePaths"].split()
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_verify(tmp_path):
    """systemd-analyze verify in a scratch root holding a stub panagg (the real path need not exist)."""
    tool = shutil.which("systemd-analyze")
    units = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
                  if (p / "sysinit.target").exists()), None)
    if tool is None or units is None:
        pytest.skip("systemd-analyze or the system unit directory is not available")
    root = tmp_path / "root"
    stub = root / "opt/panagg/.venv/bin/panagg"
    stub.parent.mkdir(parents=True)
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    shutil.copytree(units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    shutil.copy(UNIT, root / "etc/systemd/system/panagg.service")
    res = subprocess.run([tool, "verify", f"--root={root}", "panagg.service"],
                         capture_output=True, text=True, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "panagg.service" not in out, out


def test_example_config_loads_and_is_complete():
    # the real loader refuses unknown sections and keys
    cfg = load_config(str(EXAMPLE_TOML), env={})
    doc = tomllib.loads(EXAMPLE_TOML.read_text())
    documented = {(s, k) for s, keys in doc.items() for k in keys}
    expected = {(s, k) for s, keys in DEFAULTS.items() if s != "testing" for k in keys}
    assert documented == expected, (f"deploy/panagg.example.toml lacks "
                                    f"{sorted(expected - documented)}")
    state_dir = "/var/lib/" + _unit()["Service"]["StateDirectory"][-1]
    assert cfg["checkpoint"]["dir"].startswith(state_dir + "/")
    assert cfg["release"]["dir"].startswith(state_dir + "/")
    assert cfg["metrics"]["host"] == "127.0.0.1"
