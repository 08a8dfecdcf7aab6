"""Shared fixtures. ``kafka_broker`` starts a real single-node KRaft broker via deploy/kafka."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests import durations

ROOT = Path(__file__).resolve().parent.parent
KAFKA_SH = ROOT / "deploy" / "kafka" / "kafka.sh"


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """bootstrap address of a real Apache Kafka broker on 127.0.0.1 (stopped at session end)."""
    if os.environ.get("PANAGG_KAFKA_BOOTSTRAP"):
        yield os.environ["PANAGG_KAFKA_BOOTSTRAP"]
        return
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"integration tests need {', '.join(missing)} on PATH (a real broker, no mocks)"
        )
    state = tmp_path_factory.mktemp("kafka")
    res = subprocess.run(
        [str(KAFKA_SH), "start", str(state)], capture_output=True, text=True, timeout=300
    )
    if res.returncode != 0:
        pytest.fail(f"could not start Kafka: {res.stderr.strip()[-2000:]}")
    bootstrap = res.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield bootstrap
    finally:
        subprocess.run([str(KAFKA_SH), "stop", str(state)], capture_output=True, timeout=120)


class RestartableBroker:
    """A second real broker that tests may stop, kill -9 and start again (the session's
    ``kafka_broker`` is shared by every test and must stay up). One per session: a restart keeps
    its state directory, so its port and topics, and costs a warm start instead of a new broker's
    format and cold start."""

    def __init__(self, state: Path):
        self.state = state
        self.bootstrap: str | None = None

    def _sh(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(KAFKA_SH), *args, str(self.state)], capture_output=True, text=True, timeout=300
        )

    def running(self) -> bool:
        return self._sh("status").returncode == 0

    def start(self) -> str:
        res = self._sh("start")
        assert res.returncode == 0, res.stderr[-2000:]
        bootstrap = res.stdout.strip().splitlines()[-1].split("=", 1)[1]
        assert self.bootstrap in (None, bootstrap), "a restart must keep the port"
        self.bootstrap = bootstrap
        return bootstrap

    def stop(self) -> None:
        """Stop cleanly (SIGTERM, then wait)."""
        assert self._sh("stop").returncode == 0

    def kill(self) -> None:
        """kill -9 the broker process."""
        pid_file = self.state / "pid"
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        pid_file.unlink()


@pytest.fixture(scope="session")
def _restartable_broker(tmp_path_factory):
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.fail(
            f"integration tests need {', '.join(missing)} on PATH (a real broker, no mocks)"
        )
    broker = RestartableBroker(tmp_path_factory.mktemp("kafka-restartable"))
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def restartable_broker(_restartable_broker) -> RestartableBroker:
    """A broker for outage and restart tests, running when the test starts; the test may leave
    it stopped or killed (the next test that asks for it starts it again)."""
    if not _restartable_broker.running():
        _restartable_broker.start()
    return _restartable_broker


def _service_default(var: str, value: str):
    """Set ``var`` for the services the tests start (a value the environment already has wins)
    for the session, then remove it if it was not there before."""
    had = os.environ.get(var)
    os.environ.setdefault(var, value)
    yield
    if had is None:
        os.environ.pop(var, None)


@pytest.fixture(autouse=True, scope="session")
def _no_plots_in_services():
    """Services a test starts draw no release PNGs (release.plots = false): matplotlib's import
    and the drawing cost ~1 s of CPU per service start that releases, on a thread beside the
    test's own work. The tests that look at a plot set release.plots = true."""
    yield from _service_default("PANAGG_RELEASE_PLOTS", "false")


@pytest.fixture(autouse=True, scope="session")
def _no_plan_simulation_in_services():
    """Every service a test starts as a subprocess (with this environment) skips the start
    line's simulated expected errors (release.plan_errors = false): each start ran six simulated
    releases with error bars in a thread beside the test's own work, 5-25 s of CPU a start on
    a 2-core machine (one test of four kill-and-restart runs: 87 s -> 62 s without them). The
    plan is tested directly (tests/test_release_accuracy.py) and with the thread on by the tests
    that set release.plan_errors = true (tests/test_release_accuracy.py)."""
    yield from _service_default("PANAGG_RELEASE_PLAN_ERRORS", "false")


@pytest.fixture(autouse=True, scope="session")
def _no_shared_budget_registry_in_services():
    """Every service a test starts as a subprocess (with this environment) runs without the
    cluster's budget registry (ledger.registry_topic = ""): the suite shares one broker, and
    many tests run a second deployment over the same records on purpose (a control, a
    comparison of two clients, a fresh start), which the default registry would refuse, as it
    should in production. The registry is tested where it is the subject, with its own topic
    (tests/integration/test_registry_kafka.py, test_group_views.py), and the default is tested
    there with this variable removed."""
    yield from _service_default("PANAGG_LEDGER_REGISTRY_TOPIC", "")


@pytest.fixture(autouse=True)
def _file_budget_registry_per_test(tmp_path_factory, monkeypatch):
    """Each test has its own file-source budget registry (ledger.file_registry = auto:
    $XDG_STATE_HOME/panagg/budget-registry.jsonl), in the test process and in the services it
    starts: never the user's own, and never one test's charges refusing another's run over a
    file of the same content. Within one test it is shared, as two runs of one user share it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("xdg-state")))


@pytest.fixture(autouse=True)
def _no_plan_simulation_in_process(request, monkeypatch):
    """An Aggregator started inside the test process computes no simulated expected errors in
    its plan thread (the thread still starts, is cancelled and joined by close()). That thread
    re-simulated whole releases at every start of a short in-process run and was cancelled
    before it could cache them: 57 s -> 6 s for one test of tests/test_privacy_crash.py. The
    plan itself is tested directly (tests/test_release_accuracy.py); services started as
    subprocesses skip it by release.plan_errors = false (the fixture above), except the tests
    that turn it on. A test that needs the real thread in process says
    @pytest.mark.plan_thread."""
    if request.node.get_closest_marker("plan_thread") is None:
        import aggregator.service.accuracy_plan as accuracy_plan

        monkeypatch.setattr(accuracy_plan.StartPlan, "_simulate", lambda self: None)


#: fixtures that start or use a real broker (above)
_BROKER_FIXTURES = {"kafka_broker", "_restartable_broker", "restartable_broker"}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``make test`` runs the suite on three pytest-xdist workers (``-n 3 --dist loadgroup``):
    the tests on a real broker (tests/integration, the fault matrix of tests/chaos, a test with a
    broker fixture above) go to two groups, "broker" and "broker2", whole files each, balanced
    by their measured lengths (tests/durations.py), so each group runs one test at a time on
    one worker with that worker's own session broker, while the third worker takes the rest.
    With fewer than three workers every broker test is in "broker". The broker tests wait on
    windows and brokers more than they compute, so two lanes of them share two cores with the
    rest. Without xdist the mark does nothing."""
    measured = durations.load()
    on_broker = []
    for item in items:
        parts = set(Path(str(item.fspath)).parts)
        if _BROKER_FIXTURES & set(getattr(item, "fixturenames", ())) or parts & {
            "integration",
            "chaos",
        }:
            on_broker.append(item)
            item.add_marker(pytest.mark.broker)  # `make test-fast` leaves these out
        elif measured.get(item.nodeid, 0.0) > durations.SLOW_S:
            item.add_marker(pytest.mark.slow)  # measured long (tests/durations.py)
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    lanes = durations.broker_lanes(
        [(str(item.fspath), item.nodeid) for item in on_broker],
        measured,
        lanes=2 if workers >= 3 else 1,
    )
    for item in on_broker:
        item.add_marker(pytest.mark.xdist_group(lanes[str(item.fspath)]))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """Under ``--dist loadgroup`` pytest-xdist groups by a suffix it writes into each marked node
    id; a pytest that ignores the write (9.2, pytest-xdist#1386) would run the broker tests on
    both workers at once, slower and flaky. Say so instead of running."""
    config = session.config
    if not getattr(config, "workerinput", None) or not config.getvalue("loadgroup"):
        return
    lost = [
        item.nodeid
        for item in session.items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid
    ]
    if lost:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} does not let pytest-xdist group tests ({lost[0]} has no "
            f"group suffix): install the tested pytest with `pip install 'pytest<9.2'`"
        )
