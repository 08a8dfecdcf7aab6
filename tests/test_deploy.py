"""Deploy artifacts (deploy/): compose file, Dockerfile, Prometheus, Grafana, systemd, example
config.

Fast and offline. Nothing here starts a container (no Docker engine on the build machines): the
files are parsed and checked against the code they configure. The compose environment and the
example TOML go through the real ``aggregator.service.config.load_config``; every metric name in
the Grafana dashboard must be in the exposition of a real ``aggregator.service.metrics.Metrics``
registry. Where the tools exist, ``promtool``, ``systemd-analyze verify`` and ``docker compose
config`` check the files too; each of those tests skips with the reason when its tool is missing.
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
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")
# what a required variable (``${X:?message}``) stands for when the tests interpolate
REQUIRED = "<required>"


def _interpolate(value):
    """Compose variable interpolation with every variable unset: ``${X:-default}`` -> default;
    ``${X:?message}`` (compose refuses to run without X) -> REQUIRED."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if not isinstance(value, str):
        return value
    out = _VAR.sub(
        lambda m: REQUIRED if m.group(2) == "?" else m.group(3) or "", value.replace("$$", "\0")
    )
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
    return {
        k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in env.items()
    }


def _ports(service: dict) -> list[tuple[str | None, str, str]]:
    """(host_ip, host_port, container_port) of every published port, short or long syntax."""
    out = []
    for port in service.get("ports") or []:
        if isinstance(port, dict):
            out.append((port.get("host_ip"), str(port.get("published", "")), str(port["target"])))
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
                assert source in (compose.get("volumes") or {}), (
                    f"{name}: volume {source} undeclared"
                )
        build = svc.get("build")
        if build:
            context = (DEPLOY / build["context"]).resolve()
            assert context == ROOT, f"{name}: build context should be the repository root"
            assert (context / build["dockerfile"]).resolve() == DOCKERFILE


def test_compose_has_no_default_credentials(compose_raw, compose):
    """Issue 54: Grafana's admin password and the audit key have no default (compose stops,
    saying so, while GRAFANA_ADMIN_PASSWORD or PANAGG_AUDIT_KEY is unset), and no other
    password, secret or key has one either."""
    grafana = compose_raw["services"]["grafana"]["environment"]
    password = grafana["GF_SECURITY_ADMIN_PASSWORD"]
    m = _VAR.fullmatch(password)
    assert m and m.group(1) == "GRAFANA_ADMIN_PASSWORD" and m.group(2) == "?", password
    assert "docs/deploy.md" in m.group(3)  # the message says where to look
    assert _env(compose["services"]["grafana"])["GF_SECURITY_ADMIN_PASSWORD"] == REQUIRED
    for name, svc in compose["services"].items():
        for key, value in _env(svc).items():
            if re.search(r"PASSWORD|SECRET|TOKEN|(?<!PUBLIC)_KEY$", key) and not key.endswith(
                ("_FILE", "_ENV")
            ):
                assert value == REQUIRED, f"{name}: {key} has a default value"
    # the audit key too: an empty one was the default, and the aggregators refuse an empty key
    for name in AGGREGATORS:
        raw = compose_raw["services"][name]["environment"]["PANAGG_AUDIT_KEY"]
        m = _VAR.fullmatch(raw)
        assert m and m.group(1) == "PANAGG_AUDIT_KEY" and m.group(2) == "?", raw
        assert "openssl rand -hex 32" in m.group(3) and "docs/deploy.md" in m.group(3)
    header = COMPOSE.read_text().split("\nname:")[0]
    assert "GRAFANA_ADMIN_PASSWORD=" in header and "openssl rand" in header
    assert "PANAGG_AUDIT_KEY=$(openssl rand -hex 32)" in header


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
        assert cfg.source.kind == "kafka"
        assert cfg.source.bootstrap == "kafka:9092"
        assert cfg.source.group == "panagg"
        # (scale-out: time windows by the process clock; window.clock = auto cannot choose
        # the records' timestamps there)
        assert cfg.window.kind == "time"
        assert cfg.metrics.host == "0.0.0.0"
        assert env["PANAGG_STATE_EPSILON"]
        # the metrics port is the container side of the one published port
        ports = _ports(svc)
        assert [c for _, _, c in ports] == [str(cfg.metrics.port)]
        # scale-out on Kafka alone (issue 29): shared state in Kafka internal topics, each member
        # only its own scratch volume
        assert cfg.scale.partitioned is True
        assert cfg.scale.store == "kafka"
        volumes = [(s, t) for s, t in _mounts(svc) if not s.startswith((".", "/"))]
        assert len(volumes) == 1, f"{name}: expected one named (scratch) volume"
        target = volumes[0][1].rstrip("/") + "/"
        assert cfg.checkpoint.dir.startswith(target)
        assert cfg.release.dir.startswith(target)
        assert svc["depends_on"]["kafka-init"]["condition"] == "service_completed_successfully"
        assert svc["stop_signal"] == "SIGTERM" and svc.get("stop_grace_period")
    # scale.store = kafka: no volume shared (test_aggregators_share_no_volume)
    assert all("profiles" not in compose["services"][n] for n in AGGREGATORS)
    # static membership ids must differ (the derived default is the same in every container)
    ids = [c["source"]["instance_id"] for c in configs.values()]
    assert all(ids) and len(set(ids)) == len(ids), ids
    topics = {c["source"]["topic"] for c in configs.values()}
    assert len(topics) == 1
    init_cmd = compose["services"]["kafka-init"]["command"]
    assert init_cmd[init_cmd.index("--topic") + 1] in topics


def test_aggregators_share_no_volume(compose):
    """scale.store = kafka: nothing the members share is on a volume (no panagg-state any more)."""
    owners: dict[str, list[str]] = {}
    for name in AGGREGATORS:
        for source, _ in _mounts(compose["services"][name]):
            owners.setdefault(source, []).append(name)
    shared = {s: n for s, n in owners.items() if len(n) > 1}
    assert not shared, f"volumes mounted into several aggregators: {shared}"
    ids = [_agg_config(compose, n)["source"]["instance_id"] for n in AGGREGATORS]
    assert all(ids) and len(set(ids)) == len(ids), f"static-membership ids: {ids}"


def test_aggregator_healthcheck_is_healthz_on_the_metrics_port(compose):
    for name in AGGREGATORS:
        svc = compose["services"][name]
        test = " ".join(svc["healthcheck"]["test"])
        port = _agg_config(compose, name)["metrics"]["port"]
        assert f"http://127.0.0.1:{port}/healthz" in test, f"{name}: {test}"


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


LOCK = DEPLOY / "requirements.lock"


def _lock() -> dict[str, str]:
    """{canonical name: version} of deploy/requirements.lock (every line ``name==version``)."""
    pins: dict[str, str] = {}
    for raw in LOCK.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!-]+)", line)
        assert m, f"deploy/requirements.lock: {raw!r} is not an exact pin (name==version)"
        name = re.sub(r"[-_.]+", "-", m.group(1)).lower()
        assert name not in pins, f"deploy/requirements.lock pins {name} twice"
        pins[name] = m.group(2)
    return pins


def test_image_installs_exactly_the_lock():
    """Issue 54: the image's dependency versions come from the lock, not from a fresh resolve."""
    text = DOCKERFILE.read_text()
    copy = re.search(r"^COPY\s+deploy/requirements\.lock\s+(\S+)", text, flags=re.M)
    assert copy, "the Dockerfile does not copy deploy/requirements.lock"
    target = copy.group(1)
    run = " ".join(text.split("\\\n"))
    installs = re.findall(r"pip install ([^&]*)", run)
    lock_install = [i for i in installs if target in i]
    assert lock_install and "--no-deps" in lock_install[0].split(), installs
    wheel_install = [i for i in installs if "/wheels/" in i]
    assert wheel_install and "--no-deps" in wheel_install[0].split(), (
        "panagg's wheel must install without resolving its dependencies again"
    )
    assert "pip check" in run, "pip check: a lock missing a dependency fails the build"
    assert "!deploy/requirements.lock" in (DEPLOY / "Dockerfile.dockerignore").read_text().split()


def test_lock_covers_the_runtime_dependencies():
    """Every runtime dependency of pyproject is pinned, within its range, and so is every
    dependency of a locked package (as far as this environment has the locked version to read
    its metadata from); nothing from the test or bench extras is in the image."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import Requirement

    pins = _lock()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for spec in project["dependencies"]:
        req = Requirement(spec)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pins, f"deploy/requirements.lock lacks {name} (pyproject: {spec})"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"deploy/requirements.lock pins {name}=={pins[name]}, outside pyproject's {spec}"
        )
    extras = {
        re.sub(r"[-_.]+", "-", Requirement(s).name).lower()
        for group in project["optional-dependencies"].values()
        for s in group
    }
    runtime = {re.sub(r"[-_.]+", "-", Requirement(s).name).lower() for s in project["dependencies"]}
    leaked = (extras - runtime) & set(pins)
    assert not leaked, f"test or bench packages in the lock: {sorted(leaked)}"
    for name, version in pins.items():
        try:
            dist = distribution(name)
        except PackageNotFoundError:
            continue
        if dist.version != version:
            continue  # another version here: its requirements may differ from the locked one's
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            dep = re.sub(r"[-_.]+", "-", req.name).lower()
            assert dep in pins, f"deploy/requirements.lock lacks {dep}, which {name} needs"
            assert req.specifier.contains(pins[dep], prereleases=True), (
                f"{name}=={version} needs {spec}; the lock pins {dep}=={pins[dep]}"
            )


def test_every_module_directory_is_packaged():
    """A wheel (the image's, `pip install /path/to/panagg`) carries only the packages pyproject
    lists: a directory of modules left out installs a service that fails at its first import
    of it (aggregator.service.group, the Kafka-only group, was left out once)."""
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    tops = [ROOT / name for name in {p.split(".")[0] for p in listed}]
    found = {
        str(d.relative_to(ROOT)).replace("/", ".")
        for top in tops
        for d in [top, *top.rglob("*")]
        if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
    }
    assert found == listed, f"pyproject packages lacks {sorted(found - listed)}"


def test_docker_compose_config_validates():
    if shutil.which("docker") is None:
        pytest.skip("docker CLI not installed: compose file checked by parsing only")
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(
            "docker compose plugin not installed (`docker compose version` fails): "
            "compose file checked by parsing only"
        )
    res = subprocess.run(
        ["docker", "compose", "-f", str(COMPOSE), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr


# -- Prometheus ------------------------------------------------------------------------------------
def test_prometheus_scrapes_the_aggregators(compose):
    prom = yaml.safe_load(PROMETHEUS_YML.read_text())
    targets = {
        t
        for job in prom["scrape_configs"]
        for sc in job.get("static_configs", [])
        for t in sc["targets"]
    }
    expected = {f"{n}:{_agg_config(compose, n)['metrics']['port']}" for n in AGGREGATORS}
    assert targets == expected
    mounts = dict((t, s) for s, t in _mounts(compose["services"]["prometheus"]))
    assert (DEPLOY / mounts["/etc/prometheus/prometheus.yml"]).resolve() == PROMETHEUS_YML


def test_promtool_accepts_prometheus_yml():
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    res = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(PROMETHEUS_YML)],
        capture_output=True,
        text=True,
        timeout=60,
    )
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
        suffixes = {
            "counter": ["_total"],
            "histogram": ["_bucket", "_sum", "_count"],
            "gauge": [""],
        }.get(family.type, [""])
        for suffix in suffixes:
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    assert (
        "panagg_events_total" in names and "le" in names["panagg_release_duration_seconds_bucket"]
    )
    return names


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_LABEL_LIST = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
    "Inf",
    "NaN",
}
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
        if e[m.end() :].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
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
        assert not unknown, (
            f"{panel['title']}: {sorted(unknown)} not exported by "
            f"aggregator.service.metrics.Metrics (expression {expr!r})"
        )
        available = TARGET_LABELS.union(*(exposition[n] for n in names))
        assert _label_names(expr) <= available, f"{panel['title']}: unknown label in {expr!r}"
        legend = set(
            re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", target.get("legendFormat", ""))
        )
        assert legend <= available, f"{panel['title']}: legend {legend - available} not a label"


def test_dashboard_covers_the_operational_metrics(dashboard):
    used = set().union(*(_metric_names(t["expr"]) for _, t in _targets(dashboard)))
    wanted = {
        "panagg_events_total",
        "panagg_decode_errors_total",
        "panagg_releases_total",
        "panagg_releases_refused_total",
        "panagg_last_release_timestamp_seconds",
        "panagg_release_duration_seconds_bucket",
        "panagg_checkpoint_duration_seconds_bucket",
        "panagg_checkpoint_age_seconds",
        "panagg_window_progress_ratio",
        "panagg_consumer_lag_records",
        "panagg_budget_spent_epsilon",
    }
    assert wanted <= used, f"dashboard lacks {sorted(wanted - used)}"
    exprs = [t["expr"] for _, t in _targets(dashboard)]
    assert "rate(panagg_events_total[1m])" in exprs
    for hist in (
        "panagg_release_duration_seconds_bucket",
        "panagg_checkpoint_duration_seconds_bucket",
    ):
        quantiles = {
            q
            for e in exprs
            if hist in e
            for q in re.findall(r"histogram_quantile\(\s*([0-9.]+)", e)
        }
        assert {"0.5", "0.99"} <= quantiles, f"{hist}: p50 and p99 wanted, got {quantiles}"


def test_promtool_parses_every_dashboard_expression(dashboard, tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    rules = [
        {"record": f"dashboard:panel{panel['id']}:{t['refId']}", "expr": _promql(t["expr"])}
        for panel, t in _targets(dashboard)
    ]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
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
    """systemd-analyze verify in a scratch root holding a stub panagg (the real path need not
    exist)."""
    tool = shutil.which("systemd-analyze")
    units = next(
        (
            p
            for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))
            if (p / "sysinit.target").exists()
        ),
        None,
    )
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
    res = subprocess.run(
        [tool, "verify", f"--root={root}", "panagg.service"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "panagg.service" not in out, out


def test_example_config_loads_and_is_complete():
    # the real loader refuses unknown sections and keys
    cfg = load_config(str(EXAMPLE_TOML), env={})
    doc = tomllib.loads(EXAMPLE_TOML.read_text())
    documented = {(s, k) for s, keys in doc.items() for k in keys}
    expected = {(s, k) for s, keys in DEFAULTS.items() if s != "testing" for k in keys}
    assert documented == expected, (
        f"deploy/panagg.example.toml lacks {sorted(expected - documented)}"
    )
    state_dir = "/var/lib/" + _unit()["Service"]["StateDirectory"][-1]
    assert cfg.checkpoint.dir.startswith(state_dir + "/")
    assert cfg.release.dir.startswith(state_dir + "/")
    assert cfg.metrics.host == "127.0.0.1"


# -- Kubernetes (deploy/kubernetes/) ---------------------------------------------------------------
# Scale-out on Kafka alone (issue 29): a Deployment of N replicas, no volume for state, probes on
# /healthz and /ready, the config from a ConfigMap, SASL/TLS material from a Secret. Checked
# offline: the JSON schemas of the Kubernetes API (bundled with kubernetes-validate, strict: an
# unknown field fails), then the same code checks as the compose file.
K8S = DEPLOY / "kubernetes"
K8S_PVC = DEPLOY / "kubernetes-release-pvc"  # the overlay: release files on a shared volume
KUSTOMIZATION = "kustomization.yaml"


def _k8s_manifests() -> list[Path]:
    """The Kubernetes objects of deploy/kubernetes (kustomization.yaml is kustomize's, not one)."""
    return [p for p in sorted(K8S.glob("*.yaml")) if p.name != KUSTOMIZATION]


# the oldest and the newest API version the manifests are checked against (both bundled with the
# pinned kubernetes-validate)
K8S_VERSIONS = ("1.29.0", "1.37.0")
K8S_FAKE_POD = "panagg-6f9c8d7b5-x2k4q"  # what metadata.name of a Deployment's pod looks like


@pytest.fixture(scope="module")
def k8s_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in _k8s_manifests():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _k8s_one(docs, kind: str) -> dict:
    found = [d for _, d in docs if d["kind"] == kind]
    assert len(found) == 1, f"deploy/kubernetes: expected one {kind}, found {len(found)}"
    return found[0]


def _pod(docs) -> dict:
    return _k8s_one(docs, "Deployment")["spec"]["template"]["spec"]


def _container(docs) -> dict:
    containers = _pod(docs)["containers"]
    assert len(containers) == 1
    return containers[0]


def _secret_data(secret: dict) -> dict[str, str]:
    import base64

    out = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    out.update(secret.get("stringData") or {})
    return out


def _container_env(docs, secret: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it for pod K8S_FAKE_POD."""
    env = {}
    for var in _container(docs).get("env", []):
        src = var.get("valueFrom")
        if src is None:
            env[var["name"]] = str(var.get("value", ""))
        elif "fieldRef" in src:
            assert src["fieldRef"]["fieldPath"] == "metadata.name", var
            env[var["name"]] = K8S_FAKE_POD
        elif "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"], var
            data = _secret_data(secret)
            assert ref["key"] in data or ref.get("optional"), var
            if ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
        else:
            pytest.fail(f"deploy/kubernetes: env {var['name']}: unexpected source {src}")
    return env


def _k8s_config(docs, tmp_path: Path) -> tuple[dict, dict]:
    """(config, env) of one replica through the real loader: the ConfigMap's TOML with the
    Secret's files written where the Deployment mounts them (moved under tmp_path) and the
    container's environment."""
    pod, container = _pod(docs), _container(docs)
    configmap, secret = _k8s_one(docs, "ConfigMap"), _k8s_one(docs, "Secret")
    volumes = {v["name"]: v for v in pod["volumes"]}
    toml_text = None
    secret_dirs = []
    for mount in container["volumeMounts"]:
        vol = volumes[mount["name"]]
        if "configMap" in vol and mount["mountPath"] == CONTAINER_CONFIG:
            assert vol["configMap"]["name"] == configmap["metadata"]["name"]
            toml_text = configmap["data"][mount["subPath"]]
        elif "secret" in vol:
            assert vol["secret"]["secretName"] == secret["metadata"]["name"]
            data = _secret_data(secret)
            items = vol["secret"].get("items") or [{"key": k, "path": k} for k in data]
            where = tmp_path / "secret" / mount["name"]
            for item in items:
                assert item["key"] in data, f"Secret lacks {item['key']}"
                (where / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (where / item["path"]).write_text(data[item["key"]])
            secret_dirs.append((mount["mountPath"].rstrip("/") + "/", str(where) + "/"))
    assert toml_text is not None, f"no ConfigMap mounted at {CONTAINER_CONFIG}"
    for mount_path, local in secret_dirs:
        toml_text = toml_text.replace(mount_path, local)
    path = tmp_path / "panagg.toml"
    path.write_text(toml_text)
    env = _container_env(docs, secret)
    cfg = load_config(str(path), env=env)
    return cfg, env


CONTAINER_CONFIG = "/etc/panagg/panagg.toml"


def test_kubernetes_manifests_parse(k8s_docs):
    kinds = sorted(d["kind"] for _, d in k8s_docs)
    assert {"ConfigMap", "Secret", "Deployment", "Service", "NetworkPolicy"} <= set(kinds), kinds
    for name, doc in k8s_docs:
        assert doc.get("apiVersion") and doc.get("metadata", {}).get("name"), name
    assert not {"PersistentVolumeClaim", "PersistentVolume", "StatefulSet"} & set(kinds)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_validate_against_the_api_schemas(k8s_docs, version):
    import kubernetes_validate  # the test extra pins it: a missing install fails, never skips

    for name, doc in k8s_docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"deploy/kubernetes/{name}: {doc['kind']} is not valid Kubernetes "
                f"{version}: {str(exc).splitlines()[0]} at {list(exc.path)}"
            )


def test_kubernetes_config_is_scale_out_on_kafka(k8s_docs, tmp_path):
    cfg, env = _k8s_config(k8s_docs, tmp_path)
    assert cfg.source.kind == "kafka"
    assert cfg.scale.partitioned is True
    assert cfg.scale.store == "kafka"
    # static membership: the pod's name, distinct for every replica
    assert env["PANAGG_SOURCE_INSTANCE_ID"] == K8S_FAKE_POD
    assert cfg.source.instance_id == K8S_FAKE_POD
    # SASL and TLS from the Secret, never inline
    sec = cfg.security
    assert sec["protocol"] == "SASL_SSL" and sec["sasl_mechanism"].startswith("SCRAM-")
    assert sec["password_file"] and not sec["password"] and not sec["allow_inline_password"]
    assert sec["ca_file"] and sec["check_hostname"] is True
    assert (
        Path(sec["password_file"]).read_text()
        == _secret_data(_k8s_one(k8s_docs, "Secret"))["sasl-password"]
    )


def test_kubernetes_env_names_are_accepted_by_the_config_loader(k8s_docs):
    from aggregator.service.config import NON_SETTING_ENV

    known = {f"PANAGG_{s.upper()}_{k.upper()}" for s, keys in DEFAULTS.items() for k in keys}
    names = [v["name"] for v in _container(k8s_docs).get("env", [])]
    assert len(names) == len(set(names))
    unknown = {n for n in names if n.startswith("PANAGG_")} - known - set(NON_SETTING_ENV)
    assert not unknown, f"not configuration keys: {sorted(unknown)}"
    assert "PANAGG_SECURITY_PASSWORD" not in names  # the loader refuses it: secrets by file/name


def test_kubernetes_deployment_is_replicated_and_stateless(k8s_docs, tmp_path):
    deployment = _k8s_one(k8s_docs, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pod, container = _pod(k8s_docs), _container(k8s_docs)
    volumes = {v["name"]: v for v in pod["volumes"]}
    for name, vol in volumes.items():
        kinds = set(vol) - {"name"}
        assert kinds <= {"emptyDir", "configMap", "secret"}, f"volume {name}: {kinds}"
    scratch = [m for m in container["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    writable = [m["mountPath"].rstrip("/") + "/" for m in scratch if not m.get("readOnly")]
    cfg, env = _k8s_config(k8s_docs, tmp_path)
    # the root filesystem is read-only: everything written is on an emptyDir
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for what, path in (
        ("checkpoint.dir", cfg.checkpoint.dir),
        ("release.dir", cfg.release.dir),
        ("MPLCONFIGDIR", env["MPLCONFIGDIR"]),
    ):
        assert any((path.rstrip("/") + "/").startswith(w) for w in writable), (
            f"{what} = {path} is not on a writable emptyDir ({writable})"
        )
    for mount in container["volumeMounts"]:
        if set(volumes[mount["name"]]) & {"configMap", "secret"}:
            assert mount.get("readOnly") is True, mount["name"]
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["terminationGracePeriodSeconds"] >= 30  # SIGTERM: a final commit


def test_kubernetes_runs_as_the_images_user():
    text = DOCKERFILE.read_text()
    uid = int(re.search(r"useradd\b.*?--uid\s+(\d+)", text, flags=re.S).group(1))
    gid = int(re.search(r"groupadd\b.*?--gid\s+(\d+)", text, flags=re.S).group(1))
    docs = [(p.name, d) for p in _k8s_manifests() for d in yaml.safe_load_all(p.read_text()) if d]
    pod, container = _pod(docs), _container(docs)
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid and ctx["runAsGroup"] == gid
    assert ctx["fsGroup"] == gid  # the Secret's files (mode 0440) are readable by the group
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def _get(url: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_kubernetes_probes_hit_the_metrics_servers_health_endpoints(k8s_docs, tmp_path):
    """The probe paths are the health endpoints of a real Metrics server, on the port the config
    makes it listen on (the exposition answers any other path with 200: a typo would pass)."""
    from aggregator.service.metrics import Metrics

    cfg, _ = _k8s_config(k8s_docs, tmp_path)
    container = _container(k8s_docs)
    assert cfg.metrics.host == "0.0.0.0", "the kubelet probes the pod IP, not loopback"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    def target(probe):
        get = container[probe]["httpGet"]
        port = ports[get["port"]] if isinstance(get["port"], str) else get["port"]
        assert port == cfg.metrics.port, f"{probe}: port {get['port']}"
        assert get.get("scheme", "HTTP") == "HTTP"
        return get["path"]

    paths = {
        probe: target(probe)
        for probe in ("livenessProbe", "readinessProbe", "startupProbe")
        if probe in container
    }
    assert {"livenessProbe", "readinessProbe"} <= set(paths)
    m = Metrics()
    port = m.serve("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{port}"
        for probe, path in paths.items():
            code, body = _get(base + path)
            assert code == 503 and "start" in body, (
                f"{probe} {path} before the first turn: {body!r}"
            )
        m.heartbeat()
        m.set_ready(True)
        want = {"livenessProbe": "ok\n", "startupProbe": "ok\n", "readinessProbe": "ready\n"}
        for probe, path in paths.items():
            assert _get(base + path) == (200, want[probe]), f"{probe} {path}"
        m.set_ready(False, "Kafka broker unreachable")
        assert _get(base + paths["readinessProbe"])[0] == 503
        assert _get(base + paths["livenessProbe"]) == (200, "ok\n")
    finally:
        m.close()


def test_kubernetes_metrics_service_selects_the_pods(k8s_docs):
    service = _k8s_one(k8s_docs, "Service")
    labels = _k8s_one(k8s_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    names = {p["name"]: p["containerPort"] for p in _container(k8s_docs)["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in names or port["targetPort"] in names.values()
    for doc in (d for _, d in k8s_docs if d["kind"] == "PodDisruptionBudget"):
        assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


# -- issue 54: durable releases, spread replicas, a NetworkPolicy, kustomize -----------------------
def test_kubernetes_releases_go_to_a_topic_the_docs_create(k8s_docs, tmp_path):
    """Without editing a manifest, releases are durable: the ConfigMap sets release.topic (the
    leader writes each release there in the transaction that ledgers it), and docs/deploy.md
    creates that topic, compacted so that it keeps every release (a group's start refuses a
    missing one)."""
    cfg, _ = _k8s_config(k8s_docs, tmp_path)
    topic = cfg.release.topic
    assert topic, "deploy/kubernetes/configmap.yaml: release.topic is not set"
    assert topic != cfg.source.topic and not topic.startswith(f"{cfg.source.group}.panagg.")
    commands = (ROOT / "docs" / "deploy.md").read_text().replace("\\\n", " ").splitlines()
    creates = [c.split() for c in commands if "kafka-topics.sh" in c and "--create" in c]
    create = [c for c in creates if c[c.index("--topic") + 1] == topic]
    assert create, f"docs/deploy.md does not create the release topic {topic}"
    assert "cleanup.policy=compact" in create[0], " ".join(create[0])


def test_kubernetes_replicas_are_spread_over_nodes(k8s_docs):
    pod = _pod(k8s_docs)
    labels = _k8s_one(k8s_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in pod["topologySpreadConstraints"]}
    node = spread["kubernetes.io/hostname"]
    assert node["maxSkew"] == 1 and node["whenUnsatisfiable"] == "DoNotSchedule"
    assert node.get("nodeTaintsPolicy") == "Honor"  # a tainted empty node caps the others
    for c in spread.values():
        assert c["labelSelector"]["matchLabels"].items() <= labels.items()


def _bootstrap_hosts(cfg) -> list[tuple[str, int]]:
    out = []
    for server in cfg.source.bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        out.append((host, int(port)))
    return out


def test_kubernetes_network_policy_admits_prometheus_and_reaches_kafka_and_dns(k8s_docs, tmp_path):
    policy = _k8s_one(k8s_docs, "NetworkPolicy")["spec"]
    labels = _k8s_one(k8s_docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    cfg, _ = _k8s_config(k8s_docs, tmp_path)
    # in: only the metrics port, only from Prometheus pods
    metrics_port = {
        p["containerPort"] for p in _container(k8s_docs)["ports"] if p["name"] == "metrics"
    }
    assert metrics_port == {cfg.metrics.port}
    ingress_ports = {
        (p["protocol"], p["port"]) for rule in policy["ingress"] for p in rule["ports"]
    }
    assert ingress_ports == {("TCP", cfg.metrics.port)}
    for rule in policy["ingress"]:
        assert rule["from"], "an ingress rule without `from` admits every pod"
        for peer in rule["from"]:
            assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}
    # out: the brokers' ports in their namespace, and DNS; every rule names its peers and ports
    egress = policy["egress"]
    for rule in egress:
        assert rule.get("to") and rule.get("ports"), rule
    allowed = {(p["protocol"], p["port"]) for rule in egress for p in rule["ports"]}
    assert {("UDP", 53), ("TCP", 53)} <= allowed
    for host, port in _bootstrap_hosts(cfg):
        labels_ = host.split(".")
        namespace = labels_[labels_.index("svc") - 1]  # <pod>.<service>.<namespace>.svc
        reach = [
            rule
            for rule in egress
            if ("TCP", port) in {(p["protocol"], p["port"]) for p in rule["ports"]}
        ]
        peers = [peer for rule in reach for peer in rule["to"]]
        assert any(
            peer.get("namespaceSelector", {})
            .get("matchLabels", {})
            .get("kubernetes.io/metadata.name")
            == namespace
            for peer in peers
        ), f"no egress to {host}:{port} (namespace {namespace})"
    dns = [
        rule
        for rule in egress
        if ("UDP", 53) in {(p["protocol"], p["port"]) for p in rule["ports"]}
    ]
    assert all(
        peer["podSelector"]["matchLabels"] == {"k8s-app": "kube-dns"}
        for rule in dns
        for peer in rule["to"]
    )


def test_kubernetes_kustomization_applies_every_manifest_but_the_example_secret():
    kust = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert kust["kind"] == "Kustomization"
    objects = {p.name for p in _k8s_manifests()} - {"secret.example.yaml"}
    assert set(kust["resources"]) == objects
    images = {i["name"] for i in kust.get("images", [])}
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    used = {
        c["image"].rpartition(":")[0] for c in deployment["spec"]["template"]["spec"]["containers"]
    }
    assert images <= used, f"kustomization images {images} name no image of the Deployment"


def _json_patch_add(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 `add` operations (all the overlay uses), on a copy of ``doc``."""
    import copy

    doc = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add", op
        *parents, last = op["path"].lstrip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), op["value"])
        else:
            node[last] = op["value"]
    return doc


def _pvc_overlay() -> tuple[dict, dict]:
    """(the Deployment with the overlay's patch applied, the PersistentVolumeClaim)."""
    kust = yaml.safe_load((K8S_PVC / KUSTOMIZATION).read_text())
    assert (K8S_PVC / kust["resources"][0]).resolve() == K8S
    objects = [yaml.safe_load((K8S_PVC / r).read_text()) for r in kust["resources"][1:]]
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    (patch,) = kust["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "panagg"}
    deployment = yaml.safe_load((K8S / "deployment.yaml").read_text())
    ops = yaml.safe_load((K8S_PVC / patch["path"]).read_text())
    return _json_patch_add(deployment, ops), claim


def test_release_pvc_overlay_puts_release_dir_on_the_claim(k8s_docs, tmp_path):
    import kubernetes_validate

    deployment, claim = _pvc_overlay()
    for version in K8S_VERSIONS:
        for doc in (deployment, claim):
            kubernetes_validate.validate(doc, version, strict=True)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # replicas on several nodes
    pod = deployment["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert set(claims.values()) == {claim["metadata"]["name"]}
    (container,) = pod["containers"]
    cfg, _ = _k8s_config(k8s_docs, tmp_path)
    on_claim = [
        m["mountPath"].rstrip("/") + "/"
        for m in container["volumeMounts"]
        if m["name"] in claims and not m.get("readOnly")
    ]
    assert any((cfg.release.dir.rstrip("/") + "/").startswith(m) for m in on_claim), (
        f"release.dir {cfg.release.dir} is not on the claim ({on_claim})"
    )
    # the state stays scratch: only release.dir moves
    assert not any((cfg.checkpoint.dir.rstrip("/") + "/").startswith(m) for m in on_claim)


@pytest.mark.parametrize("where", [K8S, K8S_PVC], ids=["base", "release-pvc"])
def test_kubectl_kustomize_renders(where):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not installed: kustomizations checked by parsing only")
    res = subprocess.run(
        ["kubectl", "kustomize", str(where)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    rendered = [d for d in yaml.safe_load_all(res.stdout) if d]
    kinds = sorted(d["kind"] for d in rendered)
    assert "Secret" not in kinds
    if where == K8S_PVC:
        assert "PersistentVolumeClaim" in kinds
        mine, _ = _pvc_overlay()
        (theirs,) = [d for d in rendered if d["kind"] == "Deployment"]
        spec = theirs["spec"]["template"]["spec"]
        assert spec["volumes"] == mine["spec"]["template"]["spec"]["volumes"]
        assert (
            spec["containers"][0]["volumeMounts"]
            == mine["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        )
