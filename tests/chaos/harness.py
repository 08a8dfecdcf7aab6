"""One producer, one checker, every mode, the same faults (issue 46).

:func:`run_case` starts a real ``panagg run`` in one of :data:`MODES` against a real broker
(:class:`Broker`, from ``deploy/kafka/kafka.sh``), produces a steady stream of msgpack events
into a new 3-partition topic, injects one of :data:`FAULTS` while it runs, stops the producer,
lets the service settle, stops it with SIGTERM and checks the one invariant of
:mod:`tests.chaos.invariant` over what a user can read: the ledger(s), the release files and
the topic's end offsets. On top, what only the harness knows: the service never exited on its
own, every restart started, and every produced record is in a decided window or in the open
window the last checkpoint holds (``unreleased``, bounded by a window).

The suite runs a small matrix (tests/chaos/test_chaos.py); ``python -m bench.service.chaos`` runs
the full one and writes its table (docs/chaos.md).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from .invariant import DELETED, check_directory, check_rollups, check_source_spans, named_deleted

__all__ = ["Broker", "FAULTS", "MODES", "Result", "run_case"]

ROOT = Path(__file__).resolve().parents[2]
KAFKA_SH = ROOT / "deploy" / "kafka" / "kafka.sh"
PARTITIONS = 3
DOMAIN = 500


class Broker:
    """A real single-node broker in ``state`` that a fault can kill, stop and start again (a
    restart of the same directory keeps its port, so clients find it again)."""

    def __init__(self, state: Path):
        self.state = Path(state)
        self.bootstrap = ""

    def _sh(self, *args: str) -> subprocess.CompletedProcess:
        # retention is checked every 5 s (the broker's default, 5 min, would keep a topic's
        # expired records through a whole case: the fault past_retention needs them deleted)
        env = dict(os.environ, KAFKA_PROPERTIES="log.retention.check.interval.ms=5000")
        return subprocess.run(
            [str(KAFKA_SH), *args, str(self.state)],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )

    def start(self) -> str:
        done = self._sh("start")
        if done.returncode != 0:
            raise RuntimeError(f"kafka.sh start failed: {done.stderr[-2000:]}")
        self.bootstrap = done.stdout.strip().splitlines()[-1].split("=", 1)[1]
        return self.bootstrap

    def stop(self) -> None:
        self._sh("stop")

    def kill(self) -> None:
        pid_file = self.state / "pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        deadline = time.monotonic() + 30
        while self._sh("status").returncode == 0 and time.monotonic() < deadline:
            time.sleep(0.2)

    def running(self) -> bool:
        return self._sh("status").returncode == 0


@dataclass(frozen=True)
class Mode:
    """How ``panagg run`` is configured: ``sets`` are ``--set`` pairs, ``toml`` a config file's
    text (several aggregations); ``window_events`` bounds what the open window can hold at the
    harness's rate (events), for the ``unreleased`` check."""

    sets: tuple[str, ...] = ()
    toml: str = ""
    window_events: int = 0
    members: int = 0  # a group (scale.partitioned) of this many members; 0: one process
    #: the shuffle model: clients -> ``panagg shuffle`` -> the analyzer (``panagg run`` with
    #: ``state.model = shuffle``); ``sets`` are the three's shared settings
    shuffle: bool = False


RATE = 1500  # events per second of the harness's producer

MODES: dict[str, Mode] = {
    "count": Mode(("window.kind=count", "window.size=4000"), window_events=4000),
    "time": Mode(
        ("window.kind=time", "window.clock=process", "window.size=3"), window_events=8 * RATE
    ),
    "event_time": Mode(("window.kind=event_time", "window.size=3"), window_events=8 * RATE),
    "several": Mode(
        toml="""
[ledger]
budget_per_event = 2.0
[aggregations.small]
window.size = 2500
state.epsilon = 1.0
[aggregations.large]
window.size = 6000
state.epsilon = 1.0
""",
        window_events=6000,
    ),
    "rollups_sum": Mode(
        (
            "window.kind=count",
            "window.size=2000",
            'window.rollups=["3x"]',
            "window.rollup_design=sum",
        ),
        window_events=2000,
    ),
    "rollups_hybrid": Mode(
        (
            "window.kind=event_time",
            "window.size=2",
            'window.rollups=["6s"]',
            "window.rollup_design=hybrid",
        ),
        window_events=16 * RATE,
    ),
    "rollups_tree": Mode(
        (
            "window.kind=count",
            "window.size=2000",
            'window.rollups=["3x"]',
            "window.rollup_design=tree",
        ),
        window_events=6000,
    ),
}
# the same one-process modes on the librdkafka client (source.client = confluent)
for _name in ("count", "time", "event_time", "several"):
    _m = MODES[_name]
    MODES[f"{_name}_confluent"] = Mode(
        _m.sets + ("source.client=confluent",), _m.toml, _m.window_events
    )
_GROUP = (
    "scale.partitioned=true",
    "scale.store=kafka",
    "window.kind=time",
    "window.size=5",
    "source.session_timeout_s=6",
    "scale.close_grace_s=1",
)
for _k in (1, 2, 3):
    # the default exchange (views: members count their own source partitions), and items
    MODES[f"group{_k}"] = Mode(_GROUP, window_events=12 * RATE, members=_k)
    MODES[f"group_items{_k}"] = Mode(
        _GROUP + ("scale.exchange=items",), window_events=12 * RATE, members=_k
    )
    # in-window snapshots of the views exchange: a member killed -9 resumes its window from
    # its last snapshot (a rebalance that splits one withholds that window, named)
    MODES[f"group_snapshots{_k}"] = Mode(
        _GROUP + ("checkpoint.snapshots_per_window=2",), window_events=12 * RATE, members=_k
    )
    # sum rollups of the views exchange, added up by the leader
    MODES[f"group_rollups{_k}"] = Mode(
        _GROUP + ('window.rollups=["3x"]', "window.rollup_design=sum"),
        window_events=12 * RATE,
        members=_k,
    )
    # count windows of the views exchange: each member cuts at the group's reported total
    MODES[f"group_count{_k}"] = Mode(
        tuple(s for s in _GROUP if not s.startswith("window."))
        + ("window.kind=count", "window.size=6000"),
        window_events=6000 + 6 * RATE,
        members=_k,
    )
    # count and event-time windows of the items exchange (event time with views is tested in
    # tests/integration/test_group_views.py, not in this matrix yet: its ranges overlap).
    # Count windows are cut by the leader's markers at multiples of N (a window holds N plus or
    # minus about one intake poll); event-time windows by the records' timestamps, closed by the
    # leader's markers once the low watermark passes a window's end
    _items = tuple(s for s in _GROUP if not s.startswith("window.")) + ("scale.exchange=items",)
    MODES[f"group_items_count{_k}"] = Mode(
        _items + ("window.kind=count", "window.size=5000"), window_events=3 * 5000, members=_k
    )
    MODES[f"group_items_event{_k}"] = Mode(
        _items + ("window.kind=event_time", "window.size=5"), window_events=12 * RATE, members=_k
    )
    # event-time windows of the views exchange: each member windows its own partitions by
    # the records' timestamps and closes at the group's low watermark (event_views.py)
    MODES[f"group_event{_k}"] = Mode(
        tuple(s for s in _GROUP if not s.startswith("window."))
        + ("window.kind=event_time", "window.size=5", "window.allowed_lateness_s=1"),
        window_events=12 * RATE,
        members=_k,
    )

#: the shuffle model (docs/shuffle.md): GKMP at a large epsilon over few buckets, so that each
#: event is a few sealed messages (the clients' sealing is the harness's cost), count windows
#: of SHUFFLE_N events, SHUFFLE_RATE events a second
SHUFFLE_N, SHUFFLE_RATE, SHUFFLE_B = 600, 300, 40
MODES["shuffle"] = Mode(
    (
        "state.model=shuffle",
        "state.epsilon=20",
        f"state.domain_size={SHUFFLE_B}",
        "window.kind=count",
        f"window.size={SHUFFLE_N}",
        "shuffle.protocol=gkmp",
        "release.estimator=threshold",
    ),
    window_events=SHUFFLE_N,
    shuffle=True,
)

#: faults: what happens while the producer runs
FAULTS = (
    "none",
    "kill9",
    "broker_kill",
    "broker_restart",
    "slow_release",
    "start_broker_away",
    "start_together",
    "disk_full",
    "past_retention",
    "source_retention",
    "source_retention_early",
    "source_retention_frozen",
    "offsets_reset",
)

#: disk_full: the size of the service's own filesystem (state and release directories), and how
#: long each fill lasts (s)
DISK_SIZE = "8m"
FULL_S = (3.0, 6.0)
#: past_retention: the repartition topic's retention (s), how long the member stays down (s):
#: past a segment's roll (segment.ms, at least 60 s: group/topics.py), the retention and the
#: broker's check (5 s, :class:`Broker`), so records it had not counted are deleted; the session
#: timeout keeps its partitions with it meanwhile (static membership), as a pod restart would
RETENTION_S = 15
DOWN_S = 100.0
PAST_RETENTION_SETS = (
    f"scale.repartition_retention_s={RETENTION_S}",
    "source.session_timeout_s=150",
)
#: source_retention: how long every member stays down while the producer goes on (s); then the
#: source topic's records are deleted up to at most KEEP_S of production before its end (what
#: retention does to records no one read while the group was down), and the members start
#: again. The members go down once the group decided a window (its ledger holds one), at most
#: DECIDED_S after the planned moment; ``source_retention_early`` takes them down 3-6 s after
#: the start, whether or not anything was decided (a group down before its first commit);
#: ``source_retention_frozen`` freezes them instead (SIGSTOP, then SIGCONT: a stalled process
#: that reads on from where it was, one process too)
#: offsets_reset: once a window was decided, every member (or the one process) stopped (kill
#: -9 or SIGTERM), the source's consumer groups reset to the earliest record without panagg's
#: metadata (``kafka-consumer-groups --reset-offsets --to-earliest --execute``), and started
#: again: every record is read again, and none may be released twice
AWAY_S = (3.0, 6.0)
KEEP_S = 1.0
DECIDED_S = 120.0


def applies(mode: str, fault: str) -> str:
    """Why ``fault`` does not apply to ``mode`` ("" if it does)."""
    spec = MODES[mode]
    if fault == "disk_full" and spec.members:
        return "disk_full is for the one-process modes (a group's state is in Kafka)"
    if spec.shuffle and fault in (
        "disk_full",
        "past_retention",
        "start_together",
        "slow_release",
        "source_retention",
        "source_retention_early",
        "source_retention_frozen",
        "offsets_reset",
    ):
        return f"{fault} is not built for the shuffle mode yet"
    if fault == "past_retention" and spec.members < 2:
        return (
            "past_retention is for groups of 2-3 (items: the repartition topic's retention; "
            "views: the source topic's)"
        )
    if fault == "past_retention" and "window.kind=event_time" in spec.sets:
        return (
            "past_retention: event-time windows of a group have no check of records "
            "deleted before they were counted yet (docs/scale-out.md)"
        )
    if (
        fault.startswith("source_retention")
        and spec.members
        and "window.kind=event_time" in spec.sets
    ):
        return (
            f"{fault}: the event-time checks (check_event_entries) do not read "
            "spans named deleted yet; the intakes' naming is tested in "
            "tests/integration (event_time_source_records_deleted)"
        )
    return ""


@dataclass
class Result:
    mode: str
    fault: str
    seed: int
    produced: int = 0
    released: dict[str, int] = field(default_factory=dict)
    unreleased: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    faults: int = 0
    seconds: float = 0.0
    #: per broker return: seconds until the next release holding events was published (None:
    #: none before the run's end)
    resume_s: list = field(default_factory=list)
    #: per broker return: True when the next outage began before that release, which then
    #: measures that outage too (not a figure of this return)
    resume_censored: list = field(default_factory=list)
    #: why the case did not run (the fault does not apply, or cannot be made here)
    skipped: str = ""
    #: what the harness saw besides the invariant (a full disk's lines, deleted records)
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _env() -> dict:
    return dict(os.environ, PANAGG_TESTING="1", PYTHONPATH=str(ROOT))


class _Producer(threading.Thread):
    """A steady stream of ``{"item": i}`` events; rides out a broker outage (it retries; what
    it could not write is simply not in the topic, whose end offsets are the truth)."""

    def __init__(self, bootstrap: str, topic: str, rate: int, seed: int):
        super().__init__(daemon=True)
        self.bootstrap, self.topic, self.rate = bootstrap, topic, rate
        self.rng = random.Random(seed)
        self.stop = threading.Event()

    def run(self) -> None:
        from kafka import KafkaProducer

        producer = None
        i, t0 = 0, time.monotonic()
        while not self.stop.is_set():
            try:
                if producer is None:
                    producer = KafkaProducer(
                        bootstrap_servers=self.bootstrap,
                        linger_ms=5,
                        acks="all",
                        retries=5,
                        reconnect_backoff_max_ms=500,
                    )
                for _ in range(self.rate // 20):
                    item = min(int(self.rng.paretovariate(1.2)), DOMAIN - 1)
                    producer.send(self.topic, msgpack.packb({"item": item}))
                    i += 1
            except Exception:  # the broker is away: try again in a moment
                time.sleep(0.5)
                continue
            time.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
        if producer is not None:
            try:
                producer.flush(timeout=30)
                producer.close(timeout=10)
            except Exception:
                pass


def _admin(bootstrap: str):
    from kafka import KafkaAdminClient

    return KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=30000)


def _make_topic(bootstrap: str, configs: dict | None = None) -> str:
    from kafka.admin import NewTopic

    topic = f"chaos-{uuid.uuid4().hex[:8]}"
    admin = _admin(bootstrap)
    admin.create_topics([NewTopic(topic, PARTITIONS, 1, topic_configs=configs or {})])
    admin.close()
    return topic


def _ends(bootstrap: str, topic: str, first: bool = False) -> dict[str, int]:
    """Each partition's end offset (``first``: its first offset, the log start a user reads as
    any consumer does; records below it were deleted)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    ends = c.beginning_offsets(tps) if first else c.end_offsets(tps)
    c.close()
    return {f"{topic}:{tp.partition}": int(o) for tp, o in ends.items()}


def _decided(bootstrap: str, group: str) -> bool:
    """Whether the group's ledger topic holds a decided window (a release entry, withheld or
    not): its members have committed source positions since."""
    from aggregator.service.group.topics import GroupTopics

    try:
        recs = _read_topic(bootstrap, GroupTopics(group).ledger)
    except Exception:  # not made yet
        return False
    return any(
        b'"kind": "release"' in (v or b"") or b'"kind":"release"' in (v or b"")
        for part in recs.values()
        for _, v in part
    )


def _delete_records(bootstrap: str, topic: str, keep: int) -> dict[int, int]:
    """Delete each partition's records but its last ``keep`` (``kafka-delete-records``: what
    the topic's retention does to old records); returns partition -> its first offset after."""
    from kafka import TopicPartition

    cut = {
        int(k.rsplit(":", 1)[1]): max(0, end - keep) for k, end in _ends(bootstrap, topic).items()
    }
    admin = _admin(bootstrap)
    try:
        admin.delete_records({TopicPartition(topic, p): o for p, o in cut.items()})
    finally:
        admin.close()
    return cut


def _reset_offsets(bootstrap: str, topic: str, groups: list[str]) -> list[str]:
    """Reset each of ``groups`` that has offsets of ``topic`` to offset 0 with no metadata, once
    it is empty (an operator's --reset-offsets --to-earliest); returns the groups reset."""
    from kafka import TopicPartition
    from kafka.structs import OffsetAndMetadata

    admin = _admin(bootstrap)
    done = []
    try:
        for group in groups:
            deadline = time.monotonic() + 60  # offsets change only in an empty group
            while admin.describe_groups([group])[group]["group_state"] not in ("Empty", "Dead"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"consumer group {group} did not empty in 60 s")
                time.sleep(0.5)
            held = [
                tp for tp in admin.list_group_offsets(group).get(group, {}) if tp.topic == topic
            ]
            if held:
                admin.alter_group_offsets(
                    group,
                    {
                        TopicPartition(topic, p): OffsetAndMetadata(0, "", -1)
                        for p in range(PARTITIONS)
                    },
                )
                done.append(group)
    finally:
        admin.close()
    return done


class _Service:
    """``panagg run`` as a child process; every start's stderr kept."""

    def __init__(self, args: list[str], workdir: Path):
        self.args, self.workdir = args, workdir
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.problems: list[str] = []

    def start(self) -> None:
        self.starts += 1
        err = open(self.workdir / f"stderr-{self.starts}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aggregator.service.cli", *self.args],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            log = (self.workdir / f"stderr-{self.starts}.log").read_text()[-1500:]
            self.problems.append(
                f"the service exited on its own (rc {self.proc.returncode}) "
                f"in start {self.starts}: {log}"
            )
            self.start()  # what an operator's supervisor would do; the check goes on

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 120) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # SIGTERM is handled from the service's first step on; before it (the interpreter and
        # its imports, seconds on a loaded machine) the default action ends the process
        log = self.workdir / f"stderr-{self.starts}.log"
        deadline = time.monotonic() + 60
        while (
            "connecting to Kafka" not in log.read_text()
            and self.proc.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.problems.append(f"SIGTERM did not stop the service within {timeout} s")
            self.proc.kill()
            self.proc.wait()
            return
        if self.proc.returncode != 0:
            tail = (self.workdir / f"stderr-{self.starts}.log").read_text()[-1500:]
            self.problems.append(f"the stop exited {self.proc.returncode}: {tail}")


def fill_disk(path: Path) -> Path:
    """Fill the filesystem of ``path`` to its last byte (a real ENOSPC); returns the filler
    (also tests/integration/test_faults_kafka.py's)."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f:
        for block in (65536, 1):
            try:
                while True:
                    f.write(b"\0" * block)
            except OSError:
                pass
    return filler


def run_case(
    broker: Broker,
    mode: str,
    fault: str,
    seed: int,
    workdir: Path,
    *,
    seconds: float = 16.0,
    settle: float = 3.0,
    faults: int = 2,
) -> Result:
    """One run of ``mode`` under ``fault`` (module docstring); ``seed`` draws the fault's
    moments and the events; ``faults`` kills, broker outages or disk fills at random moments
    of the run. A fault that does not apply to the mode, or a full disk where no filesystem
    can be mounted (root, CAP_SYS_ADMIN), returns a Result with ``skipped`` set."""
    why = applies(mode, fault)
    if why:
        return Result(mode, fault, seed, skipped=why)
    if MODES[mode].shuffle:
        from .shuffle_case import run_shuffle_case

        return run_shuffle_case(
            broker, mode, fault, seed, Path(workdir), seconds=seconds, settle=settle, faults=faults
        )
    if fault != "disk_full":
        return _run_case(
            broker, mode, fault, seed, Path(workdir), seconds=seconds, settle=settle, faults=faults
        )
    disk = Path(workdir) / "disk"
    disk.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        return Result(
            mode,
            fault,
            seed,
            skipped="cannot mount a small tmpfs for the full disk "
            f"(root or CAP_SYS_ADMIN needed): {mounted.stderr.strip()}",
        )
    try:
        return _run_case(
            broker,
            mode,
            fault,
            seed,
            Path(workdir),
            seconds=seconds,
            settle=settle,
            faults=faults,
            disk=disk,
        )
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _supervise(services, seconds: float, every_s: float) -> None:
    """Wait ``seconds`` while a fault lasts, restarting any of ``services`` that exited on its
    own meanwhile (:meth:`_Service.check_alive`: what an operator's supervisor does)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for svc in services:
            svc.check_alive()
        time.sleep(every_s)


def _run_case(
    broker: Broker,
    mode: str,
    fault: str,
    seed: int,
    workdir: Path,
    *,
    seconds: float,
    settle: float,
    faults: int,
    disk: Path | None = None,
) -> Result:
    rng = random.Random(seed)
    spec = MODES[mode]
    res = Result(mode, fault, seed)
    t_start = time.monotonic()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not broker.running():
        broker.start()
    # past_retention of a views group: the source topic's own retention deletes what a member
    # down longer than it had not counted (segments roll every 5 s, so the retention is real)
    views_retention = fault == "past_retention" and "scale.exchange=items" not in spec.sets
    topic = _make_topic(
        broker.bootstrap,
        {"retention.ms": str(RETENTION_S * 1000), "segment.ms": "5000"}
        if views_retention
        else None,
    )
    group = f"g-{topic}"
    common = [
        "run",
        "--bootstrap",
        broker.bootstrap,
        "--topic",
        topic,
        "--metrics-port",
        "-1",
        "--set",
        f"source.group={group}",
        "--set",
        f"state.domain_size={DOMAIN}",
        "--set",
        "release.error_bar_reps=0",
        "--set",
        "source.connect_timeout_s=60",
    ]
    if spec.toml:
        (workdir / "mode.toml").write_text(spec.toml)
        common += ["--config", str(workdir / "mode.toml")]
    for s in spec.sets:
        common += ["--set", s]
    if fault == "slow_release":
        # releases much slower than the windows: the release path falls behind
        common += ["--set", "release.error_bar_reps=400", "--set", "release.max_in_flight=2"]
    if fault == "past_retention":
        for s in PAST_RETENTION_SETS:
            common += ["--set", s]
    data = disk or workdir  # where the one process's state and releases are

    def args_of(name: str) -> list[str]:
        home = workdir / name if name else data
        own = ["--state-dir", str(home / "state"), "--release-dir", str(home / "releases")]
        return common + own + (["--set", f"source.instance_id={name}"] if name else [])

    names = [f"m{k}" for k in range(1, spec.members + 1)] or [""]
    for name in names:
        (workdir / name).mkdir(parents=True, exist_ok=True)
    services = {name: _Service(args_of(name), workdir / name) for name in names}
    producer = _Producer(broker.bootstrap, topic, RATE, seed)
    producer.start()
    recorder = None
    if fault == "past_retention" and not views_retention:
        # what a reader of the repartition topic sees while it runs: retention deletes records
        # the checker must still count (the released windows' n, the gaps no window names).
        # Not for the source topic: its records are one event an offset, and what its
        # retention deleted is accounted for by the ledger's names (invariant.py, rule 6)
        from aggregator.service.group.topics import GroupTopics

        recorder = _Recorder(broker.bootstrap, GroupTopics(group).repartition)
        recorder.start()
    returns: list[float] = []  # wall-clock times the broker came back
    outages: list[float] = []  # and the times it went away
    if fault == "start_broker_away":
        time.sleep(rng.uniform(1, 3))
        outages.append(time.time())
        broker.stop()
        for svc in services.values():
            svc.start()
        time.sleep(rng.uniform(2, 6))
        broker.start()
        returns.append(time.time())
        res.faults += 1
    elif fault == "start_together" or len(names) == 1:
        time.sleep(rng.uniform(0.5, 2))
        for svc in services.values():
            svc.start()
        res.faults += fault == "start_together"
    else:  # the first member makes the group, the others join
        services[names[0]].start()
        time.sleep(4)
        for name in names[1:]:
            services[name].start()
    t0 = time.monotonic()
    planned = sorted(rng.uniform(2, seconds - 2) for _ in range(faults))
    end = t0 + seconds
    if fault == "past_retention":
        planned = [rng.uniform(3, 6)]
    # source_retention: when every member goes down (looked at again each second until the
    # group decided a window, up to give_up)
    due: float | None = None
    give_up = 0.0
    if fault.startswith("source_retention") or fault == "offsets_reset":
        planned = []
        due = t0 + rng.uniform(3, 6)
        give_up = due + DECIDED_S
    # (one process decides its first window within seconds; a group's start takes longer)
    wait_decided = (
        fault in ("source_retention", "source_retention_frozen")
        and bool(spec.members)
        or fault == "offsets_reset"
        and bool(spec.members)
    )
    while time.monotonic() < end:
        for svc in services.values():
            svc.check_alive()
        if planned and time.monotonic() >= t0 + planned[0] and fault == "disk_full":
            planned.pop(0)
            res.faults += 1
            assert disk is not None
            filler = fill_disk(disk)
            _supervise(services.values(), rng.uniform(*FULL_S), 0.2)
            filler.unlink()
        if planned and time.monotonic() >= t0 + planned[0] and fault == "past_retention":
            planned.pop(0)
            res.faults += 1
            # a member that does not lead (the leader's own stall is another fault)
            others = [
                n
                for n in names[1:]
                if "leading" not in (workdir / n / f"stderr-{services[n].starts}.log").read_text()
            ] or names[1:]
            down = rng.choice(others)
            services[down].kill9()
            _supervise([svc for name, svc in services.items() if name != down], DOWN_S, 0.5)
            services[down].start()
            res.notes.append(f"{down} down {DOWN_S:g} s (retention {RETENTION_S} s)")
            end = max(end, time.monotonic() + 15)
        if (
            due is not None
            and time.monotonic() >= due
            and wait_decided
            and time.monotonic() < give_up
            and not _decided(broker.bootstrap, group)
        ):
            due = time.monotonic() + 1.0
            end = max(end, due + 1.0)
        elif due is not None and time.monotonic() >= due:
            due = None
            res.faults += 1
            res.notes.append(
                f"members down {time.monotonic() - t0:.0f} s in"
                + (
                    ""
                    if not wait_decided
                    else ", once a window was decided"
                    if time.monotonic() < give_up
                    else f", no window decided within {DECIDED_S:g} s"
                )
            )
            # every member down (killed -9, stopped or frozen), so that no one reads meanwhile
            how = (
                "sigstop"
                if fault == "source_retention_frozen"
                else rng.choice(("kill9", "sigterm"))
            )
            for svc in services.values():
                if how == "kill9":
                    svc.kill9()
                elif how == "sigterm":
                    svc.stop()
                elif svc.proc is not None:
                    svc.proc.send_signal(signal.SIGSTOP)
            away = rng.uniform(*AWAY_S)
            time.sleep(away)
            if fault == "offsets_reset":
                reset = _reset_offsets(broker.bootstrap, topic, [group, f"{group}.panagg.count"])
                res.notes.append(
                    f"every member {how}; consumer group(s) {', '.join(reset)} "
                    "reset to offset 0 without metadata"
                )
            else:
                cut = _delete_records(
                    broker.bootstrap, topic, keep=rng.randint(0, int(KEEP_S * RATE) // PARTITIONS)
                )
                res.notes.append(
                    f"every member {how} and down {away:.1f} s; the source's "
                    f"records deleted below {cut}"
                )
            if how == "sigstop":
                for svc in services.values():
                    if svc.proc is not None:
                        svc.proc.send_signal(signal.SIGCONT)
            else:
                services[names[0]].start()
                for name in names[1:]:
                    time.sleep(1)
                    services[name].start()
            end = max(end, time.monotonic() + 15)
        if (
            planned
            and time.monotonic() >= t0 + planned[0]
            and fault in ("kill9", "broker_kill", "broker_restart")
        ):
            planned.pop(0)
            res.faults += 1
            if fault == "kill9":
                victim = services[rng.choice(names)]
                victim.kill9()
                time.sleep(rng.uniform(0, 1.5))
                victim.start()
            elif fault == "broker_kill":
                outages.append(time.time())
                broker.kill()
                time.sleep(rng.uniform(1, 5))
                broker.start()
                returns.append(time.time())
            else:
                outages.append(time.time())
                broker.stop()
                time.sleep(rng.uniform(1, 5))
                broker.start()
                returns.append(time.time())
        time.sleep(0.2)
    producer.stop.set()
    producer.join(60)
    time.sleep(settle if spec.members == 0 else settle + 25)
    if spec.members:
        try:
            published = [
                ts
                for recs in _read_topic(
                    broker.bootstrap, f"{group}.panagg.releases", stamps=True
                ).values()
                for _, value, ts in recs
                if _holds_events(value)
            ]
        except Exception:  # no release topic: the group never released (the check says so)
            published = []
    else:
        published = [
            p.stat().st_mtime
            for p in (data / "releases").rglob("release-*.json")
            if _holds_events(p.read_bytes())
        ]
    for back in returns:
        later = [t - back for t in published if t > back]
        res.resume_s.append(round(min(later), 2) if later else None)
        nxt = [t - back for t in outages if t > back]
        res.resume_censored.append(bool(nxt) and (not later or min(nxt) < min(later)))
    for svc in services.values():
        svc.check_alive()
    for svc in services.values():
        svc.stop()
    # a last start reads the topic to its end and publishes what is pending, then exits: what a
    # user finds once the service caught up (the open window stays open)
    if disk is not None:
        full = sum(p.read_text().count("No space left") for p in workdir.glob("stderr-*.log"))
        res.notes.append(f"{full} log line(s) saying 'No space left'")
    # (a slow release path drains slowly: 400 error-bar repetitions a release, on a loaded
    # machine about a minute each)
    drain_s = 1800 if fault == "slow_release" else 600
    try:
        drain = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                *args_of(names[0]),
                "--exit-when-idle",
                "20" if spec.members else "4",
            ],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=drain_s,
        )
    except subprocess.TimeoutExpired as exc:  # said as a violation; the matrix goes on
        err = (
            exc.stderr.decode(errors="replace")
            if isinstance(exc.stderr, bytes)
            else (exc.stderr or "")
        )
        drain = subprocess.CompletedProcess(
            exc.cmd, -1, "", err + f"\n[harness] the draining start ran past {drain_s} s"
        )
    (workdir / "stderr-drain.log").write_text(drain.stderr)
    for name, svc in services.items():
        res.violations += [f"[{name or mode}] {p}" for p in svc.problems]
    if drain.returncode != 0:
        res.violations.append(
            f"the draining start exited {drain.returncode}: {drain.stderr[-1500:]}"
        )
    ends = _ends(broker.bootstrap, topic)
    res.produced = sum(ends.values())
    if spec.members:
        if recorder is not None:
            recorder.stop.set()
            recorder.join(60)
        _check_group(res, broker.bootstrap, group, spec, topic, recorder)
    else:
        report = check_directory(
            data / "state",
            data / "releases",
            ends=ends,
            begins={p: 0 for p in ends},
            lows=_ends(broker.bootstrap, topic, first=True),
        )
        if not report:
            res.violations.append("no aggregation has a ledger")
        for name, cov in report.items():
            label = name or mode
            res.violations += [f"[{label}] {v}" for v in cov.violations]
            if cov.rollups:
                res.notes.append(f"[{label}] {cov.rollups} sum rollup publication(s) checked")
            res.released[label] = cov.released_events
            left = sum(ends[p] - cov.covered.get(p, 0) for p in ends)
            res.unreleased[label] = left
            if left > spec.window_events:
                res.violations.append(
                    f"[{label}] {left} records after the last decided "
                    f"window: more than the open window can hold "
                    f"({spec.window_events})"
                )
    res.seconds = time.monotonic() - t_start
    return res


def _holds_events(document: bytes | None) -> bool:
    """Whether a release document counts events (a time window's release of an intake that
    waited holds none: it is no sign of intake resumed); an unreadable one counts."""
    try:
        n = json.loads(document or b"{}").get("n", 1)
    except (ValueError, AttributeError):
        return True
    return n is None or n > 0  # (null: add-remove states do not publish n)


def _read_topic(
    bootstrap: str, topic: str, stamps: bool = False, headers: bool = False
) -> dict[int, list]:
    """Every committed record of ``topic``: ``{partition: [(offset, value)]}`` (``stamps``:
    ``(offset, value, timestamp in s)``; ``headers``: ``(offset, value, {header: bytes})``)."""
    from kafka import KafkaConsumer, TopicPartition

    c = KafkaConsumer(
        bootstrap_servers=bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        group_id=None,
    )
    parts = sorted(c.partitions_for_topic(topic) or ())
    tps = [TopicPartition(topic, p) for p in parts]
    out: dict[int, list] = {p: [] for p in parts}
    if tps:
        c.assign(tps)
        c.seek_to_beginning(*tps)
        end = c.end_offsets(tps)
        deadline = time.monotonic() + 60
        while any(c.position(tp) < end[tp] for tp in tps) and time.monotonic() < deadline:
            for tp, recs in c.poll(timeout_ms=500).items():
                out[tp.partition].extend(
                    (r.offset, r.value, r.timestamp / 1000)
                    if stamps
                    else (r.offset, r.value, dict(r.headers or ()))
                    if headers
                    else (r.offset, r.value)
                    for r in recs
                )
    c.close()
    return out


class _Recorder(threading.Thread):
    """Reads ``topic`` (committed records) from its beginning while the case runs, so that
    what its retention deletes later is still known: ``events[p][offset]`` (4 bytes an event),
    and per partition ``began`` (the first offset there was when it started reading) and
    ``skipped`` (offsets it jumped over: deleted before it read them)."""

    def __init__(self, bootstrap: str, topic: str, per_record: bool = False):
        super().__init__(daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        #: one event a record (a source topic), not 4 bytes an event (a repartition topic)
        self.per_record = per_record
        self.events: dict[int, dict[int, int]] = {}
        self.began: dict[int, int] = {}
        self.skipped: list[tuple[int, int, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from kafka import KafkaConsumer, TopicPartition

        while not self.stop.is_set():  # the first member makes the topic (never this reader:
            try:  # a consumer's metadata request could auto-create it)
                admin = _admin(self.bootstrap)
                there = self.topic in admin.list_topics()
                admin.close()
            except Exception:
                there = False
            if there:
                break
            time.sleep(1)
        if self.stop.is_set():
            return
        c = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            isolation_level="read_committed",
            enable_auto_commit=False,
            group_id=None,
            auto_offset_reset="earliest",
        )
        parts: list[int] = []
        deadline = time.monotonic() + 60
        while not parts and time.monotonic() < deadline:
            parts = sorted(c.partitions_for_topic(self.topic) or ())
            time.sleep(0.5)
        tps = [TopicPartition(self.topic, p) for p in parts]
        c.assign(tps)
        c.seek_to_beginning(*tps)
        self.began = {tp.partition: int(o) for tp, o in c.beginning_offsets(tps).items()}
        last = {p: self.began[p] - 1 for p in parts}
        # read on a while after the stop: the records written before it
        stop_at = None
        while stop_at is None or time.monotonic() < stop_at:
            if stop_at is None and self.stop.is_set():
                stop_at = time.monotonic() + 10
            for tp, recs in c.poll(timeout_ms=500).items():
                mine = self.events.setdefault(tp.partition, {})
                for r in recs:
                    if r.offset > last[tp.partition] + 1000:  # more than markers: deleted
                        self.skipped.append((tp.partition, last[tp.partition] + 1, r.offset))
                    last[tp.partition] = r.offset
                    mine[r.offset] = 1 if self.per_record else len(r.value or b"") // 4
        c.close()


def check_group_entries(
    entries: list[dict],
    docs: dict[int, list[dict]],
    events_at: dict[str, dict[int, int]],
    readable_from: dict[str, int],
    skips_empty: bool = False,
    lows: dict[str, int] | None = None,
):
    """The invariant over a group's ledger ``entries`` and publications ``docs``:
    :func:`~tests.chaos.invariant.check_aggregation` with ``events_at`` (per position key, the
    events at each offset the harness read). A withheld window (a ``release`` entry with
    ``withheld``: its ``ranges`` hold the partitions that were not refused) counts as a refused
    window whose ranges are those plus the ones its reason names for the refused partitions
    ("records of partition p ... window range [a, b)"; a reason naming only the deleted span
    names no range of the window). Offsets in no window are excused only where the harness read
    them and they hold no event (transaction markers): offsets below ``readable_from`` (deleted
    before anyone read them) in no window are lost without a name. And a window released with a
    partition's range empty right where that partition's records were deleted by retention
    before they were counted (a withheld window names them) is published short: the deleted
    records may be its own (docs/scale-out.md: every window they may fall in is withheld).
    ``lows``: the source's first offsets now (rule 6 of :mod:`.invariant`: what an entry names
    deleted must be gone).

    >>> rk = "r:1"
    >>> events = {"r:0": {o: 1 for o in range(40)}, rk: {o: 1 for o in range(40)}}
    >>> rel = lambda w, r0, r1: {"kind": "release", "window": w, "n": (r0[1] - r0[0]) +
    ...     (r1[1] - r1[0]), "ranges": {"r:0": r0, rk: r1}, "totals": {"rejects": {}}}
    >>> why = ("records of partition 1 from offset 10 to 30 were deleted by the repartition "
    ...        "topic's retention before they were counted (scale.repartition_retention_s); "
    ...        "window range [10, 30) cannot be released whole")
    >>> held = {"kind": "release", "window": 1, "withheld": why, "ranges": {"r:0": [10, 20]}}
    >>> docs = {0: [{"n": 20}], 2: [{"n": 20}]}
    >>> good = [rel(0, [0, 10], [0, 10]), held, rel(2, [20, 40], [30, 40])]
    >>> good[2]["n"] = 30
    >>> docs[2] = [{"n": 30}]
    >>> check_group_entries(good, docs, events, {"r:0": 0, rk: 30}).violations
    []
    >>> # the defect of issue 46: the reason names another partition, the next window is
    >>> # released with partition 1's range empty: offsets 10-30 lost without a name
    >>> bad = [good[0], dict(held, withheld=why.replace("partition 1", "partition 0")),
    ...        rel(2, [20, 40], [30, 30]), rel(3, [40, 40], [30, 40])]
    >>> docs = {0: [{"n": 20}], 2: [{"n": 20}], 3: [{"n": 10}]}
    >>> check_group_entries(bad, docs, events, {"r:0": 0, rk: 30}).violations[-1]
    'r:1: offsets [10, 30) between windows 0 and 2 are in no window'
    >>> # the same when the harness never read them (deleted first): not excused as markers
    >>> gone = {"r:0": events["r:0"], rk: {o: 1 for o in range(30, 40)}}
    >>> check_group_entries(bad, docs, gone, {"r:0": 0, rk: 30}).violations[-1]
    'r:1: offsets [10, 30) between windows 0 and 2 are in no window'
    >>> # count windows (``skips_empty``): a window the leader cut with no event is neither
    >>> # ledgered nor released, so its number is missing; excused only where the windows
    >>> # around it meet on every partition (its ranges would hold no event)
    >>> cut = [rel(0, [0, 10], [0, 10]), rel(2, [10, 40], [10, 40])]
    >>> cdocs = {0: [{"n": 20}], 2: [{"n": 60}]}
    >>> check_group_entries(cut, cdocs, events, {}).violations
    ['windows missing between 0 and 2: [1]']
    >>> check_group_entries(cut, cdocs, events, {}, skips_empty=True).violations
    []
    >>> # a lost count window (events in it) is still flagged, and so is a doubled one
    >>> lost = [rel(0, [0, 10], [0, 10]), rel(2, [20, 40], [20, 40])]
    >>> cdocs = {0: [{"n": 20}], 2: [{"n": 40}]}
    >>> v = check_group_entries(lost, cdocs, events, {}, skips_empty=True).violations
    >>> v[0]
    'window 1 is missing and held events: r:0 [10, 20) holds 10; r:1 [10, 20) holds 10'
    >>> v[1]
    'r:0: offsets [10, 20) between windows 0 and 2 are in no window'
    >>> twice = [rel(0, [0, 10], [0, 10]), rel(1, [10, 40], [10, 40]), rel(1, [10, 40], [10, 40])]
    >>> cdocs = {0: [{"n": 20}], 1: [{"n": 60}]}
    >>> check_group_entries(twice, cdocs, events, {}, skips_empty=True).violations[0]
    'windows decided twice in the ledger: [1]'
    >>> # every position named, but window 2 released with partition 1 empty after the deletion
    >>> short = [good[0], held, rel(2, [20, 40], [30, 30]), rel(3, [40, 40], [30, 40])]
    >>> check_group_entries(short, docs, events, {"r:0": 0, rk: 30}).violations[0][:60]
    "window 2: released with r:1's range empty at 30, where recor"
    """
    from .invariant import check_aggregation

    def size_of(part: str, a: int, b: int) -> int:
        return sum(k for off, k in events_at.get(part, {}).items() if a <= off < b)

    # (a reason holds "; " itself: "...(scale.repartition_retention_s); window range [a, b)")
    named = re.compile(
        r"records of partition (\d+) from offset (\d+) to (\d+)"
        r"(?:(?:(?!records of partition).)*?window range \[(\d+), (\d+)\))?"
    )
    keys = {k.rsplit(":", 1)[1]: k for k in list(events_at) + list(readable_from)}
    fixed = []
    deleted_end: dict[str, list[tuple[int, int]]] = {}  # key: (end of deleted records, window)
    for e in entries:
        if e.get("kind") == "release" and e.get("withheld"):
            ranges = dict(e.get("ranges") or {})
            for m in named.finditer(str(e["withheld"])):
                reason = m.group(0)
                said = DELETED.match(str(e["withheld"]), m.start())  # a source deletion
                if said and not any(k == f"{said.group(4)}:{m.group(1)}" for k in keys.values()):
                    continue  # another topic's partition (items: the source's)
                if m.group(1) in keys:
                    # the deleted span is not the window's range (a window resumed there ends
                    # where the first record left is): only a named window range tiles
                    if m.group(4):
                        ranges.setdefault(keys[m.group(1)], [int(m.group(4)), int(m.group(5))])
                    # (a source deletion, named by the window open when reading went on:
                    # windows are the intake's or the member's processing time, so the
                    # next window cannot hold them)
                    if "retention" in reason and not said:
                        deleted_end.setdefault(keys[m.group(1)], []).append(
                            (int(m.group(3)), int(e["window"]))
                        )
            e = dict(e, kind="refused", ranges=ranges)
        fixed.append(e)
    # every partition is counted from its first offset (the topics are new): events before
    # the first window are in no window
    cov = check_aggregation(
        fixed, docs, topic_docs=None, size_of=size_of, begins={k: 0 for k in events_at}, lows=lows
    )
    kept = []
    if skips_empty:
        kept += _excuse_empty(fixed, cov, size_of)
    for v in cov.violations:
        if skips_empty and v.startswith("windows missing between"):
            continue  # said by _excuse_empty, window by window
        if " are in no window" in v:
            part, rest = v.split(": offsets [", 1)
            a, b = (int(x) for x in rest.split(")", 1)[0].split(", "))
            if size_of(part, a, b) == 0 and a >= readable_from.get(part, 0):
                continue  # markers only
        kept.append(v)
    for e in fixed:
        if e.get("kind") != "release":
            continue
        for key, ends_at in deleted_end.items():
            r = (e.get("ranges") or {}).get(key)
            for x, u in ends_at:
                if r is not None and r[0] == r[1] == x and e["window"] > u:
                    kept.append(
                        f"window {e['window']}: released with {key}'s range empty at "
                        f"{x}, where records deleted by retention before they were "
                        f"counted end (withheld window {u} names them): they may be "
                        "this window's"
                    )
    cov.violations = kept
    return cov


def _excuse_empty(entries: list[dict], cov, size_of) -> list[str]:
    """Count windows of a group: a window number missing from the ledger is a window the
    leader cut with no event (docs/scale-out.md, "Count windows": not released, its number
    skipped). It is excused where, on every partition, the decided windows before and after
    it meet, or what lies between holds no event; otherwise it is a lost window."""
    decided = {e["window"]: e for e in entries if e.get("kind") in ("release", "refused")}
    if not decided:
        return []
    out = []
    ids = sorted(decided)
    for m in sorted(set(range(ids[0], ids[-1] + 1)) - set(ids)):
        before = decided[max(i for i in ids if i < m)].get("ranges") or {}
        after = decided[min(i for i in ids if i > m)].get("ranges") or {}
        held = []
        for part in sorted(set(before) | set(after)):
            if part in before and part in after:
                a, b = before[part][1], after[part][0]
                if b > a and size_of(part, a, b):
                    held.append(f"{part} [{a}, {b}) holds {size_of(part, a, b)}")
            else:
                held.append(f"{part} has a range on one side only")
        if held:
            out.append(f"window {m} is missing and held events: {'; '.join(held)}")
    return out


def event_windows_of(records: dict[str, list]) -> tuple[dict[str, list], int, int]:
    """Where each event of a group's repartition topic counts, with event-time windows, by the
    rule a user can read in docs/scale-out.md ("Event-time windows", 3): per partition, the
    leader's close markers (header ``close`` K: windows <= K end there; before its first marker
    nothing is counted, then the partition is read again from its first offset as if that
    marker were before it) and each message's window (header ``w``, ``late`` if the intake found
    it late): a message counts in its window unless a marker before it closed that window, then
    in the window after the last closed one (``window.late = next``). ``records``: per position
    key, ``[(offset, value, headers)]`` in offset order. Returns ``({key: [(offset, window,
    events)]}, events the intake sent late, events late at the counting partition)``.

    >>> recs = {"r:0": [(0, b"x" * 8, {"w": b"5"}), (1, b"", {"close": b"4"}),
    ...                 (2, b"x" * 4, {"w": b"6"}), (3, b"", {"close": b"5"}),
    ...                 (4, b"x" * 4, {"w": b"5"}), (5, b"x" * 4, {"w": b"6", "late": b"1"})]}
    >>> event_windows_of(recs)  # offset 4: window 5 closed at 3, so late here (in 6)
    ({'r:0': [(0, 5, 2), (2, 6, 1), (4, 6, 1), (5, 6, 1)]}, 1, 1)
    """
    out: dict[str, list] = {}
    late_intake = late_here = 0
    for key, recs in records.items():
        marks = [int(h["close"]) for _, _, h in recs if "close" in h]
        mine = out.setdefault(key, [])
        if not marks:
            # no marker yet: the leader closed nothing (markers go to every partition at once);
            # the events are in their open windows
            mine += [(off, int(h["w"]), len(v or b"") // 4) for off, v, h in recs if "w" in h]
            continue
        closed = marks[0]
        for off, v, h in recs:
            if "close" in h:
                closed = max(closed, int(h["close"]))
                continue
            if "w" not in h:
                continue
            k = len(v or b"") // 4
            w = int(h["w"])
            late_intake += k if "late" in h else 0
            if w <= closed:
                w = closed + 1
                late_here += k if "late" not in h else 0
            mine.append((off, w, k))
    return out, late_intake, late_here


def event_windows_by_stamp(
    records: dict[str, list], size_s: float, lateness_s: float
) -> tuple[dict[str, list], int]:
    """Where each source record of a views group counts with event-time windows, by the rule
    docs/scale-out.md states: the window its timestamp names, unless its partition had already
    passed that window's end plus the lateness (a larger timestamp earlier in the partition):
    then it is late and counts in the first window its partition had not passed
    (``window.late = next``). ``records``: per position key, ``[(offset, value, timestamp in
    s)]`` in offset order. Returns ``({key: [(offset, window, 1)]}, late records)``.

    >>> event_windows_by_stamp({"t:0": [(0, b"", 1.5), (1, b"", 2.6), (2, b"", 1.2),
    ...                                 (3, b"", 3.1)]}, 1.0, 0.5)
    ({'t:0': [(0, 1, 1), (1, 2, 1), (2, 2, 1), (3, 3, 1)]}, 1)
    """
    size, lateness = round(size_s * 1000), round(lateness_s * 1000)
    out: dict[str, list] = {}
    late = 0
    for key, recs in records.items():
        passed = None
        mine = out.setdefault(key, [])
        for off, _, ts in recs:
            ms = round(ts * 1000)
            w = ms // size
            if passed is not None and w < (passed - lateness) // size:
                w = (passed - lateness) // size
                late += 1
            mine.append((off, w, 1))
            passed = ms if passed is None else max(passed, ms)
    return out, late


def check_event_entries(
    entries: list[dict], docs: dict[int, list[dict]], assigned: dict[str, list]
):
    """The invariant over an event-time group's ledger ``entries`` and publications ``docs``,
    with ``assigned`` (:func:`event_windows_of`: where each event of the repartition topic
    counts). A partition holds several live windows, so windows' ranges overlap (window K's
    range on a partition runs from its first record to K's close marker) and "ranges tile the
    source" does not apply; instead:

    1. every ``release`` or ``refused`` entry is one window, none twice; a window number missing
       between the first and the last is one no event counts in (the leader skips it);
    2. every event counts in exactly one window (by the rule of :func:`event_windows_of`), and
       that window is decided unless it is after the last decided one (still open);
    3. each event of window K lies within K's ledgered range on its partition;
    4. each release's ``n`` plus its rejected and filtered records equals the events counting
       in it;
    5. each release is published with the ledger's ``n``, with one content, and no document
       exists without its release entry.

    >>> recs = {"r:0": [(0, b"", {"close": b"4"}), (1, b"x" * 8, {"w": b"5"}),
    ...                 (2, b"x" * 4, {"w": b"6"}), (3, b"", {"close": b"5"}),
    ...                 (4, b"x" * 4, {"w": b"6"}), (5, b"", {"close": b"6"}),
    ...                 (6, b"x" * 4, {"w": b"7"})],
    ...         "r:1": [(0, b"", {"close": b"4"}), (1, b"x" * 4, {"w": b"5"}),
    ...                 (2, b"", {"close": b"5"}), (3, b"", {"close": b"6"})]}
    >>> assigned = event_windows_of(recs)[0]
    >>> rel = lambda w, n, r0, r1: {"kind": "release", "window": w, "n": n,
    ...     "ranges": {"r:0": r0, "r:1": r1}, "totals": {"rejects": {}}}
    >>> good = [rel(5, 3, [1, 4], [1, 3]), rel(6, 2, [2, 6], [4, 4])]
    >>> docs = {5: [{"n": 3}], 6: [{"n": 2}]}
    >>> cov = check_event_entries(good, docs, assigned)
    >>> cov.violations, cov.released_events, cov.covered
    ([], 5, {'r:0': 1, 'r:1': 0})
    >>> # a window decided twice, and a window lost (its events in no decided window)
    >>> check_event_entries(good + [good[1]], docs, assigned).violations
    ['windows decided twice in the ledger: [6]']
    >>> lost = [good[0], rel(7, 1, [6, 7], [4, 4])]
    >>> check_event_entries(lost, {5: [{"n": 3}], 7: [{"n": 1}]}, assigned).violations
    ['window 6: 2 events count in it (r:0 offsets 2-4) but the ledger has no entry of it']
    >>> # a window released short, and one whose range leaves out one of its events
    >>> short = [rel(5, 2, [1, 4], [1, 3]), rel(6, 2, [3, 6], [4, 4])]
    >>> for v in check_event_entries(short, {5: [{"n": 2}], 6: [{"n": 2}]}, assigned).violations:
    ...     print(v)
    window 5: n 2 + 0 rejected/filtered but 3 events count in it
    window 6: r:0 offsets [2, 2] count in it but lie outside its range [3, 6)
    """
    from .invariant import Coverage, _content, _window_others

    cov = Coverage()
    bad = cov.violations.append
    decided = []
    for e in entries:
        if e.get("kind") == "release" and e.get("withheld"):
            e = dict(e, kind="refused")
        if e.get("kind") in ("release", "refused"):
            decided.append(e)
    ids = [e["window"] for e in decided]
    if len(ids) != len(set(ids)):
        bad(f"windows decided twice in the ledger: {sorted({w for w in ids if ids.count(w) > 1})}")
    by_window: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for key, recs in assigned.items():
        for off, w, k in recs:
            if k:
                by_window.setdefault(w, {}).setdefault(key, []).append((off, k))
    last = max(ids) if ids else None
    for w in sorted(by_window):
        if w in ids or last is None or w > last:
            continue
        n = sum(k for recs in by_window[w].values() for _, k in recs)
        where = "; ".join(
            f"{key} offsets {recs[0][0]}-{recs[-1][0]}"
            for key, recs in sorted(by_window[w].items())
        )
        bad(f"window {w}: {n} events count in it ({where}) but the ledger has no entry of it")
    for e in sorted(decided, key=lambda e: e["window"]):
        w = e["window"]
        ranges = e.get("ranges") or {}
        mine = by_window.get(w, {})
        size = sum(k for recs in mine.values() for _, k in recs)
        for key, recs in sorted(mine.items()):
            a, b = ranges.get(key, (0, 0))
            out = [off for off, _ in recs if not a <= off < b]
            if out:
                bad(
                    f"window {w}: {key} offsets [{min(out)}, {max(out)}] count in it but lie "
                    f"outside its range [{a}, {b})"
                )
        if e["kind"] == "refused":
            cov.refused.append(w)
            continue
        cov.windows.append(w)
        n = int(e["n"])
        cov.released_events += n
        other = _window_others(decided, e)
        if n + other != size:
            bad(f"window {w}: n {n} + {other} rejected/filtered but {size} events count in it")
        published = docs.get(w, [])
        if not published:
            bad(f"window {w}: released in the ledger but no release document")
        for doc in published:
            if doc.get("n") != n:
                bad(f"window {w}: a published document says n={doc.get('n')}, the ledger {n}")
        if len({_content(d) for d in published}) > 1:
            bad(
                f"window {w}: published with {len({_content(d) for d in published})} "
                "different contents"
            )
    for w in sorted(docs):
        if w not in cov.windows:
            bad(f"window {w}: a document is published but the ledger has no release of it")
    # what is still open: the events of windows after the last decided one
    for key, recs in assigned.items():
        cov.covered[key] = sum(k for _, w, k in recs if last is None or w > last)
    return cov


def _check_group(
    res: Result,
    bootstrap: str,
    group: str,
    spec: Mode,
    topic: str,
    recorder: _Recorder | None = None,
) -> None:
    """The invariant over a group's topics: its ledger topic's windows and its release topic's
    publications. The ledger's ranges are source positions (scale.exchange = views: one event
    an offset), or positions of the repartition topic (items: each record there holds the
    events of one source record, 4 bytes an event); ``recorder`` read the repartition topic
    while the case ran (what its retention deleted since is known from it). Source records
    deleted before they were counted are accounted for where a withheld window names them and
    the source no longer holds them (invariant.py, rule 6; items: every source offset in one
    repartition message's ``src`` span or named, :func:`~.invariant.check_source_spans`)."""
    import json

    from kafka import KafkaConsumer, TopicPartition

    from aggregator.service.group.topics import GroupTopics

    topics = GroupTopics(group)
    try:
        ledger_records = _read_topic(bootstrap, topics.ledger)
        published = _read_topic(bootstrap, topics.releases)
    except Exception as exc:  # no topics: the group never started
        res.violations.append(f"the group's topics cannot be read: {type(exc).__name__}: {exc}")
        return
    entries = [json.loads(v) for recs in ledger_records.values() for _, v in recs if v is not None]
    entries = [e for e in entries if isinstance(e, dict)]
    ident = next((e.get("identity") or {} for e in entries if e.get("kind") == "identity"), {})
    views = ident.get("exchange") == "views"
    kind = ident.get("window_kind") or next(
        (x.split("=", 1)[1] for x in spec.sets if x.startswith("window.kind=")), "time"
    )
    try:
        read = _read_topic(bootstrap, topic if views else topics.repartition, headers=not views)
    except Exception as exc:
        res.violations.append(f"the group's input cannot be read: {type(exc).__name__}: {exc}")
        return
    docs: dict[int, list[dict]] = {}
    rollup_docs: list[dict] = []
    for recs in published.values():
        for _, v in recs:
            if v is None:
                continue
            doc = json.loads(v)
            if "rollup" not in doc and isinstance(doc.get("window"), int):
                docs.setdefault(doc["window"], []).append(doc)
            elif "rollup" in doc:
                rollup_docs.append(doc)
    name = topic if views else topics.repartition
    ends = _ends(bootstrap, topic)
    source_lows = _ends(bootstrap, topic, first=True)
    if views:
        # one event an offset (the harness's producer writes no transaction markers), read or
        # deleted since: what a released window's range holds is its length
        events_at = {key: dict.fromkeys(range(end), 1) for key, end in ends.items()}
    else:
        events_at = {
            f"{topics.repartition}:{p}": {off: len(v or b"") // 4 for off, v, _ in recs}
            for p, recs in read.items()
        }
    if kind == "event_time" and not views:
        _check_event_group(
            res,
            spec,
            entries,
            docs,
            {f"{topics.repartition}:{p}": recs for p, recs in read.items()},
        )
        return
    if kind == "event_time":
        stamped = _read_topic(bootstrap, topic, stamps=True)
        size_s = float(ident.get("window_size", 5))
        lateness_s = float(ident.get("allowed_lateness_s", 0.0))
        assigned, late = event_windows_by_stamp(
            {f"{topic}:{p}": recs for p, recs in stamped.items()}, size_s, lateness_s
        )
        cov = check_event_entries(entries, docs, assigned)
        res.violations += [f"[group] {v}" for v in cov.violations]
        res.released["group"] = cov.released_events
        left = sum(cov.covered.values())
        res.unreleased["group"] = left
        res.notes.append(
            f"{len(cov.windows)} windows released, {len(cov.refused)} withheld; "
            f"{late} late events by their partitions' timestamps"
        )
        if left > spec.window_events:
            res.violations.append(
                f"[group] {left} events after the last decided window: more "
                f"than the open window can hold ({spec.window_events})"
            )
        return
    c = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    lows = {
        f"{name}:{tp.partition}": int(o)
        for tp, o in c.beginning_offsets([TopicPartition(name, p) for p in read]).items()
    }
    c.close()
    readable_from = {} if views else dict(lows)
    if recorder is not None:
        for p, seen in recorder.events.items():
            key = f"{name}:{p}"
            for off, k in seen.items():
                events_at.setdefault(key, {}).setdefault(off, k)
            readable_from[key] = min(lows.get(key, 0), recorder.began.get(p, 0))
        for p, a, b in recorder.skipped:
            res.violations.append(
                f"[harness] offsets [{a}, {b}) of {name}:{p} were deleted "
                "before the harness read them"
            )
        deleted = {k: v for k, v in lows.items() if v > 0}
        res.notes.append(
            f"retention deleted the repartition topic's offsets below {deleted}"
            if deleted
            else "retention deleted nothing"
        )
        held = [e["window"] for e in entries if e.get("withheld")]
        res.notes.append(f"windows withheld: {held}")
    # time windows of a group: only released windows are published; offsets between ranges
    # may hold transaction markers (no event), which size_of counts as nothing
    cov = check_group_entries(
        entries, docs, events_at, readable_from, skips_empty=kind == "count", lows=source_lows
    )
    named = named_deleted([dict(e, kind="refused") if e.get("withheld") else e for e in entries])
    deleted = cov.deleted
    if not views:
        # the ledger's ranges are repartition positions: the source's are in the messages
        counted: dict[str, list[tuple[int, int]]] = {}
        for recs in read.values():
            for _, _, headers in recs:
                if "src" in headers:
                    src_topic, p, a, b = headers["src"].decode().rsplit(":", 3)
                    counted.setdefault(f"{src_topic}:{p}", []).append((int(a), int(b)))
        res.violations += [
            f"[group] {v}" for v in check_source_spans(counted, named, ends, source_lows)
        ]
    if named or any(source_lows.values()):
        res.notes.append(
            f"source records deleted below {source_lows}; withheld windows name "
            f"{deleted} of them deleted before they were counted"
        )
    if kind == "count":
        ids = sorted(cov.windows + cov.refused)
        skipped = sorted(set(range(ids[0], ids[-1] + 1)) - set(ids)) if ids else []
        res.notes.append(
            f"{len(cov.windows)} windows released, {len(cov.refused)} withheld, "
            f"skipped with no event: {skipped}"
        )
    res.violations += [f"[group] {v}" for v in cov.violations]
    res.violations += [f"[group] {v}" for v in check_rollups(entries, docs, rollup_docs)]
    if rollup_docs:
        res.notes.append(f"[group] {len(rollup_docs)} sum rollup publication(s) checked")

    def size_of(part: str, a: int, b: int) -> int:
        return sum(k for off, k in events_at.get(part, {}).items() if a <= off < b)

    total = sum(sum(m.values()) for m in events_at.values())
    if not views and total + deleted != res.produced:
        res.violations.append(
            f"[group] the repartition topic holds {total} events and "
            f"{deleted} are named deleted, of {res.produced} source records"
        )
    res.released["group"] = cov.released_events
    left = sum(size_of(part, cov.covered.get(part, 0), 1 << 62) for part in events_at)
    res.unreleased["group"] = left
    if left > spec.window_events:
        res.violations.append(
            f"[group] {left} events after the last decided window: more "
            f"than the open window can hold ({spec.window_events})"
        )


def _check_event_group(
    res: Result,
    spec: Mode,
    entries: list[dict],
    docs: dict[int, list[dict]],
    records: dict[str, list],
) -> None:
    """:func:`check_event_entries` over an event-time group's topics (``records``: its
    repartition topic with headers), and every produced event in the repartition topic once."""
    assigned, late_intake, late_here = event_windows_of(records)
    cov = check_event_entries(entries, docs, assigned)
    res.violations += [f"[group] {v}" for v in cov.violations]
    total = sum(k for recs in assigned.values() for _, _, k in recs)
    if total != res.produced:
        res.violations.append(
            f"[group] the repartition topic holds {total} events of {res.produced} source records"
        )
    res.released["group"] = cov.released_events
    left = sum(cov.covered.values())
    res.unreleased["group"] = left
    ids = sorted(cov.windows + cov.refused)
    skipped = sorted(set(range(ids[0], ids[-1] + 1)) - set(ids)) if ids else []
    res.notes.append(
        f"{len(cov.windows)} windows released, {len(cov.refused)} withheld, "
        f"{len(skipped)} skipped with no event; late events: {late_intake} by "
        f"the intake, {late_here} at a counting partition (window.late = next)"
    )
    if left > spec.window_events:
        res.violations.append(
            f"[group] {left} events after the last decided window: more "
            f"than the open window can hold ({spec.window_events})"
        )
