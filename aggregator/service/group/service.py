"""A member of a scale-out group whose only shared medium is Kafka (``scale.store = "kafka"``).

Wires the pieces of :mod:`aggregator.service.group` in one loop: intake (the
:class:`~.repartition.Repartitioner`), counting (the :class:`~.counter.Counter`) and, while the
group assigns this member the ledger's partition, the :class:`~.leader.Leader`. Each turn polls
each stage briefly; the leader's merges run in the release worker, never in the loop.

Start, in order (a refused start writes nothing of its own):
1. reach Kafka, find the source topic, create or check the internal topics;
2. read the ledger; if it is empty, write the group's identity (mode, counters, epsilon,
   partitions, window size, hash key, first window) as its first entry, with the leader's
   transactional id (so two members starting at once write one identity); if it is not, check
   this member's settings against it (one line when they differ);
3. join the counting group (subscribed to the repartition topic and the ledger topic: whoever
   gets the ledger's partition leads) and the source topic's group (intake).
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from pathlib import Path

from kafka import ConsumerRebalanceListener, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient
from kafka.errors import (
    InvalidProducerEpochError,
    InvalidTxnStateError,
    KafkaError,
    ProducerFencedError,
)
from kafka.structs import OffsetAndMetadata
from prometheus_client import CollectorRegistry

from consumers.kafka import compat
from consumers.kafka_security import KafkaConnectError, client_options, redacted
from state_store.atomic import atomic_write

from ..config import aggregation_configs, parse_start
from ..errors import ServiceError
from ..metrics import Metrics
from ..release_worker import ReleaseWorker
from ..settings import Config
from ..stages.labelled import ByAggregation
from .pipeline import MUST_AGREE, Pipeline
from .repartition import Repartitioner
from .topics import GroupTopicError
from .txn import Transactions, close_producer

__all__ = ["GroupService", "MUST_AGREE"]

log = logging.getLogger("panagg.group")


class GroupService:
    """One member of the group ``source.group`` (see the module docstring)."""

    def __init__(
        self, cfg: Config, metrics, *, fresh_start: bool = False, accept_change: bool = False
    ):
        if fresh_start or accept_change:
            raise ServiceError(
                "--fresh-start and --accept-change do not apply to scale.store = "
                "kafka: the group's state is its Kafka topics (use another "
                "source.group for a new group)"
            )
        self.cfg, self.metrics = cfg, metrics
        src = cfg.source
        self.instance = (
            src.instance_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        )
        self.security = client_options(cfg.security)
        named = aggregation_configs(cfg)
        if named:
            # each aggregation its own series (labelled aggregation=NAME, as one process does):
            # a shared set would mix their counts and let their last-release gauges overwrite
            # each other

            self.pipelines = [Pipeline(name, one, self, Metrics()) for name, one in named]
            metrics.registry = CollectorRegistry()
            metrics.registry.register(
                ByAggregation({p.name: p.metrics.registry for p in self.pipelines})
            )
        else:
            self.pipelines = [Pipeline("", cfg, self, metrics)]
        self.stop_event = threading.Event()
        self.on_started = None
        self.worker = None
        #: scale.exchange = views: no intake stage; each member counts source partitions
        self.views = cfg.scale.exchange == "views"
        self.intake = None
        self._clients: list = []
        self._txns: list[Transactions] = []
        self._outage_logged: dict[str, float] = {}
        self._reported = 0.0
        self._lag_labels: set[str] = set()
        self._plain = None
        #: where this member's metrics are served (set by the CLI), for panagg status --group
        self.metrics_url = ""
        #: the source topic's partitions ("<topic>:<p>"): event time's watermark is over them
        self.source_partitions: list[str] = []

    # -- Kafka clients -----------------------------------------------------------------------
    def _common(self) -> dict:
        return dict(
            bootstrap_servers=self.cfg.source.bootstrap,
            reconnect_backoff_max_ms=1000,
            **self.security,
        )

    def _holds_entries(self, topic: str) -> bool:
        """Whether the one-partition ``topic`` holds a committed record: a ledger topic that
        does not is one another member is making now (members started together), or one a
        reader's metadata request made on a broker that creates topics on first use."""
        tp = TopicPartition(topic, 0)
        reader = self.consumer(None)
        try:
            return bool(reader.end_offsets([tp]).get(tp))
        finally:
            reader.close()
            self._clients.remove(reader)

    def consumer(self, group: str | None, **extra):
        src = self.cfg.source
        conf = dict(
            self._common(),
            group_id=group,
            enable_auto_commit=False,
            isolation_level="read_committed",
            auto_offset_reset="earliest",
            client_id=f"panagg-{self.instance}",
            fetch_max_bytes=src.fetch_max_bytes,
            max_partition_fetch_bytes=src.max_partition_fetch_bytes,
        )
        if group is not None:
            conf.update(
                session_timeout_ms=int(src.session_timeout_s * 1000),
                heartbeat_interval_ms=int(min(3.0, src.session_timeout_s / 3) * 1000),
            )
        conf.update(extra)
        c = KafkaConsumer(**conf)
        self._clients.append(c)
        _checked(compat.check_consumer, c)
        return c

    def producer(self, transactional_id: str, keep: bool = True):
        p = KafkaProducer(
            **self._common(),
            transactional_id=transactional_id,
            transaction_timeout_ms=15000,
            linger_ms=5,
            max_request_size=16 * 1024 * 1024,
        )
        try:
            _checked(compat.check_producer, p, transactional=True)
            p.init_transactions()
        except Exception:
            close_producer(p)
            raise
        if keep:
            self._clients.append(p)
        return p

    def transactions(self, transactional_id: str) -> Transactions:
        txn = Transactions(lambda: self.producer(transactional_id, keep=False))
        self._txns.append(txn)
        return txn

    # -- start -------------------------------------------------------------------------------
    def _partitions(self, admin) -> int:
        src = self.cfg.source
        want = int(self.cfg.scale.partitions)
        found = [
            d
            for d in admin.describe_topics([src.topic])
            if d.get("topic", d.get("name")) == src.topic
        ]
        have = len(found[0].get("partitions") or []) if found else 0
        if not have:
            raise ServiceError(
                f"topic {src.topic!r} does not exist on the cluster: create it "
                "(panagg reads it, never creates it) or fix source.topic"
            )
        self.source_partitions = [f"{src.topic}:{p}" for p in range(have)]
        if self.views:
            # each member counts whole source partitions: the group's partitions are the
            # source's (a views group checks that the source keeps them: its identity)
            if want and want != have:
                raise ServiceError(
                    f"scale.partitions = {want} applies to scale.exchange = items; "
                    f"with views the group counts the {have} partitions of "
                    f"{src.topic}: remove scale.partitions"
                )
            return have
        return want or have

    def _retrying(self, call, what: str):
        """``call()``, retried while Kafka answers with a retriable error (a broker that has
        just started has no group coordinator yet) for up to source.connect_timeout_s; then one
        line."""

        deadline = time.monotonic() + float(self.cfg.source.connect_timeout_s)
        while True:
            try:
                return call()
            except KafkaError as exc:
                if not getattr(exc, "retriable", False) or time.monotonic() > deadline:
                    raise ServiceError(
                        f"{what} failed ({type(exc).__name__}); check that the "
                        "Kafka cluster is up and this client may describe the "
                        "group"
                    ) from None
                time.sleep(0.5)

    def _check_directory(self) -> None:
        """A directory the shared-directory store used is not scratch: its ledger records
        privacy spent. A member never takes it over (a silent switch would forget the charges)."""
        d = Path(self.cfg.checkpoint.dir)
        if (d / "ledger.jsonl").exists() or (d / "partitions").is_dir():
            raise ServiceError(
                f"checkpoint.dir {d} holds a state directory of one process or of the removed "
                "shared-directory scale-out (its ledger.jsonl records the privacy spent): keep it "
                "as it is and give each member an empty scratch checkpoint.dir; with the same "
                "source.group the group starts at its committed offsets, so nothing is counted "
                "twice"
            )

    def _check_release_topics(self, existing: set[str]) -> None:
        """release.topic must exist: the leader sends each release there inside the transaction
        that ledgers it, so a missing topic would hold every window undecided (and a broker
        that creates topics on first use would make it with its default retention, deleting
        releases after a week). Refused before anything is written."""
        for topic in sorted({p.cfg.release.topic for p in self.pipelines} - {""}):
            if topic not in existing:
                raise ServiceError(
                    f"release.topic {topic!r} does not exist on the cluster: create it once, "
                    f"compacted so that it keeps every release (kafka-topics.sh --create --topic "
                    f"{topic} --partitions 1 --config cleanup.policy=compact), or unset "
                    "release.topic"
                )

    def start(self) -> None:
        cfg = self.cfg
        self._check_directory()
        admin = KafkaAdminClient(
            **self._common(), request_timeout_ms=int(cfg.source.connect_timeout_s * 1000)
        )
        try:
            P = self._partitions(admin)
            anchors = {}
            existing = set(admin.list_topics())
            self._check_release_topics(existing)
            for pipe in self.pipelines:
                anchors[pipe.name] = self._retrying(
                    lambda: pipe.anchor(admin), "reading the group's committed offsets"
                )
                if anchors[pipe.name] and pipe.topics.ledger not in existing:
                    raise ServiceError(
                        f"the ledger topic {pipe.topics.ledger} is missing, but the group's "
                        f"committed offsets record {anchors[pipe.name]['seq']} ledger entries: "
                        "it was deleted; restore it (the ledger is the record of privacy "
                        "spent), or start a new group (another source.group) knowing the old "
                        "charges are not carried over"
                    )
            intake = self.pipelines[0].topics.intake
            if (
                not self.views
                and intake not in existing
                and any(
                    self._holds_entries(pipe.topics.ledger)
                    for pipe in self.pipelines
                    if pipe.topics.ledger in existing
                )
            ):
                # its marks are what keeps a record from being repartitioned twice: rebuilt
                # from nothing, a reset's re-read would be counted and released again
                raise ServiceError(
                    f"the intake topic {intake} is missing, but the group's ledger topic "
                    "exists: it was deleted, and with it the marks that keep a record from "
                    "being counted twice; restore it, or start a new group (another "
                    "source.group): the budget registry then withholds the records this group "
                    "released"
                )
            src_topic = cfg.source.topic
            listed = self._retrying(
                lambda: admin.list_group_offsets(cfg.source.group),
                "reading the source group's committed offsets",
            )
            committed = {
                tp.partition: om.offset
                for tp, om in (listed.get(cfg.source.group) or {}).items()
                if tp.topic == src_topic and om.offset is not None and om.offset > 0
            }
            for pipe in self.pipelines:
                # (a count window's duration is not known: a week, and a replay that finds its
                # window's first records deleted withholds the window, counter.py)
                retention = cfg.scale.repartition_retention_s or (
                    7 * 86400.0
                    if pipe.cfg.window.kind == "count"
                    else max(3 * float(pipe.cfg.window.size), 3600.0)
                )
                for line in pipe.topics.ensure(
                    admin,
                    P,
                    int(retention * 1000),
                    views=self.views,
                    snapshots=bool(pipe.cfg.checkpoint.snapshots_per_window),
                ):
                    log.info(line)
        except GroupTopicError as exc:
            raise ServiceError(str(exc)) from None
        finally:
            admin.close()
        seed = self._start_seed()
        for i, pipe in enumerate(self.pipelines):
            # one group, one start: the first aggregation's identity carries it (a views group:
            # each aggregation's counting group is placed by its own identity's transaction)
            pipe.open_ledger(
                P,
                anchors[pipe.name],
                seed=seed(pipe) if seed is not None and (i == 0 or self.views) else None,
            )
        if cfg.release.workers:
            self.worker = ReleaseWorker(cfg.release.workers)
        group_opts = {"group_instance_id": self.instance} if cfg.source.instance_id else {}
        for pipe in self.pipelines:
            pipe.start_counting(self.instance, group_opts)
        self._started_lines()
        if self.views:
            return
        intake = self.consumer(
            cfg.source.group, **group_opts, max_poll_records=cfg.source.max_records
        )
        marks = self.pipelines[0].topics.intake
        self.intake = Repartitioner(
            intake,
            self.transactions(f"{cfg.source.group}.panagg.intake.{self.instance}"),
            [pipe.route(P) for pipe in self.pipelines],
            max_records=cfg.source.max_records,
            marks_topic=marks,
            marks_reader=self.consumer(None),
        )
        rp = self.intake

        class _Marks(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                pass

            def on_partitions_assigned(self, assigned):
                rp.read_marks()  # a partition may come with marks another member wrote
                rp.assigned(assigned)

        intake.subscribe([cfg.source.topic], listener=_Marks())
        self._seed_marks(committed)

    def _started_lines(self) -> None:
        for pipe in self.pipelines:  # a rollup level's is its share
            pipe.metrics.epsilon.set(float(pipe.cfg.state.epsilon))
        self._save_config()
        for pipe in self.pipelines:
            if self.views:
                size = pipe.identity["window_size"]
                windows = (
                    f"count windows of {int(size):,} events of the group, cut by each "
                    "member at the group's reported total"
                    if pipe.identity.get("window_kind") == "count"
                    else f"windows of {size:g} s by event time (allowed lateness "
                    f"{pipe.identity['allowed_lateness_s']:g} s), closed at the group's "
                    "low watermark"
                    if pipe.identity.get("window_kind") == "event_time"
                    else f"windows of {size:g} s by this member's clock"
                )
                log.info(
                    "member %s of %s: scale.exchange = views: counts its own partitions of "
                    "%s into its own pan-private state (%s mode, %d counters, %s); it "
                    "writes only eps-DP views to %s.*",
                    self.instance,
                    pipe.about,
                    self.cfg.source.topic,
                    pipe.identity["mode"],
                    pipe.size,
                    windows,
                    pipe.topics.prefix,
                )
                continue
            kind, size = pipe.identity.get("window_kind"), pipe.identity["window_size"]
            windows = (
                f"count windows of {int(size):,} events, cut by the leader"
                if kind == "count"
                else f"windows of {size:g} s by event time (allowed lateness "
                f"{pipe.identity['allowed_lateness_s']:g} s)"
                if kind == "event_time"
                else f"windows of {size:g} s by intake time"
            )
            P = int(pipe.identity["partitions"])
            log.info(
                "member %s of %s: %d partition(s), %s mode with %d counters split into %d "
                "slices, %s; shared state only in %s.*",
                self.instance,
                pipe.about,
                P,
                pipe.identity["mode"],
                pipe.size,
                P,
                windows,
                pipe.topics.prefix,
            )
            log.warning(
                "scale.exchange = items: %s holds every event's counter index in "
                "plaintext (kept %s) and anyone who can read it learns them; the "
                "default scale.exchange = views keeps every internal topic eps-DP "
                "(docs/privacy.md section 20)",
                pipe.topics.repartition,
                f"{self.cfg.scale.repartition_retention_s:g} s"
                if self.cfg.scale.repartition_retention_s
                else "three windows, at least one hour",
            )

    def _start_seed(self):
        """``source.start`` (earliest, latest, or a time) for a new group: the source offsets it
        places the group at, as a function that writes them (the source group's committed
        offsets and the intake's marks) into the transaction of the group's identity; None when
        the topic's partitions are not known yet. Earliest is the first record each partition
        still holds: committed at once, so that records the topic's retention deletes before a
        member first reads them are seen as deleted (group/deleted.py), not skipped unnamed."""

        src = self.cfg.source
        start = parse_start(src.start)
        probe = self.consumer(None)
        try:
            parts = probe.partitions_for_topic(src.topic) or set()
            tps = [TopicPartition(src.topic, p) for p in sorted(parts)]
            if not tps:
                return None
            ends = probe.end_offsets(tps)
            if start == "earliest":
                at = probe.beginning_offsets(tps)
            elif start == "latest":
                at = ends
            else:
                found = probe.offsets_for_times({tp: int(start) for tp in tps})
                at = {
                    tp: (found[tp].offset if found.get(tp) is not None else ends[tp]) for tp in tps
                }
        finally:
            self.discard(probe)
        marks = self.pipelines[0].topics.intake
        views = self.views

        def seed_of(pipe):
            def seed(txn):
                if views:
                    # the member's counting group reads the source: it starts there
                    txn.send_offsets(
                        {tp: OffsetAndMetadata(int(off), "", -1) for tp, off in at.items()},
                        pipe.topics.counting_group,
                    )
                else:
                    for tp, off in at.items():
                        txn.send(
                            marks,
                            partition=0,
                            key=f"{tp.topic}:{tp.partition}".encode(),
                            value=str(int(off)).encode(),
                        )
                    txn.send_offsets(
                        {tp: OffsetAndMetadata(int(off), "", -1) for tp, off in at.items()},
                        src.group,
                    )
                log_start()

            return seed

        def log_start():
            log.info(
                "new group %s starts at %s (source.start = %s): %s",
                src.group,
                "the earliest retained records"
                if start == "earliest"
                else "the latest offsets"
                if start == "latest"
                else "the first records at or after it",
                src.start,
                ", ".join(f"{tp.partition} at {off}" for tp, off in sorted(at.items())),
            )

        return seed_of

    def _seed_marks(self, committed: dict[int, int]) -> None:
        """Source partitions the group's offsets show as read (by this group before, by one
        process, or by the removed shared-directory store) but without a high-water mark: their
        committed offset becomes the mark, so a later reset of the offsets cannot re-read what
        was counted before the marks existed."""
        topic = self.cfg.source.topic
        seeds = {p: o for p, o in committed.items() if (topic, p) not in self.intake.marks}
        if not seeds:
            return
        txn = self.intake.txn
        txn.begin()
        for p, o in sorted(seeds.items()):
            txn.send(
                self.intake.marks_topic,
                partition=0,
                key=f"{topic}:{p}".encode(),
                value=str(o).encode(),
            )
        txn.commit()
        for p, o in seeds.items():
            self.intake.marks[(topic, p)] = o
        log.info(
            "source partitions %s: the group's committed offsets are their first marks "
            "(records below them are never repartitioned)",
            ", ".join(str(p) for p in sorted(seeds)),
        )

    def _save_config(self) -> None:
        """The member's config (no secrets) in its scratch directory: commands run on that
        directory then know it is a member of a Kafka-only group and say what applies."""
        d = Path(self.cfg.checkpoint.dir)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write(
            d / "config.json", json.dumps(redacted(self.cfg), indent=1, sort_keys=True), mode=None
        )

    # -- the loop ----------------------------------------------------------------------------
    def _start_retrying(self) -> None:
        """:meth:`start`, tried again while Kafka answers with a passing error, for up to
        source.connect_timeout_s; then one line. Passing: a broker that is restarting (no
        coordinator yet, timeouts) and ``ProducerFencedError``, which a member gets when
        another one starting at the same instant wrote the new group's identity with the same
        transactional id: its next try reads that identity (members started together once
        exited here, issue 46), or ``InvalidTxnStateError``, which the broker answers a producer
        whose transaction that other member's fencing cut short (seen in the suite: a member of
        two started together exited with it). A try that failed leaves nothing of its own behind
        (its clients are closed; the identity is written in one transaction or not at all)."""

        passing = (ProducerFencedError, InvalidProducerEpochError, InvalidTxnStateError)
        wait_s = float(self.cfg.source.connect_timeout_s)
        deadline = time.monotonic() + wait_s
        tries = 0
        while True:
            tries += 1
            try:
                self.start()
                return
            except KafkaError as exc:
                self.close()
                again = getattr(exc, "retriable", False) or isinstance(exc, passing)
                if not again or time.monotonic() > deadline:
                    raise ServiceError(
                        f"the group could not start: Kafka answered {type(exc).__name__}"
                        + (f" for {wait_s:g} s (source.connect_timeout_s)" if again else "")
                        + "; check the cluster and try again"
                    ) from None
                if tries == 1:
                    log.info(
                        "the group's start met %s (a broker restarting, or another member "
                        "starting at the same time); trying again for up to %g s",
                        type(exc).__name__,
                        wait_s,
                    )
            except Exception:
                self.close()
                raise
            # jittered: members that fenced each other do not meet again at the same instant
            time.sleep(random.uniform(0.5, 2.0))

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.1) -> None:
        self._start_retrying()
        self._set_ready(True)
        if self.on_started is not None:
            self.on_started()
        idle_since = time.monotonic()
        failed = False
        try:
            while not self.stop_event.is_set():
                took = (
                    self._stage("intake", None, self.intake.step, poll_timeout_s)
                    if self.intake is not None
                    else 0
                )
                counted = 0
                wait = poll_timeout_s / len(self.pipelines)
                for pipe in self.pipelines:
                    counted += self._stage("counting", pipe, pipe.counter.step, wait)
                    self._stage("leading", pipe, pipe.lead)
                self.metrics.heartbeat()
                self._update_ready()
                self._report()
                if (
                    took
                    or counted
                    or any(p.leader is not None and p.leader.busy for p in self.pipelines)
                ):
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
        except BaseException:
            failed = True
            raise
        finally:
            held = self._held()  # before close: leaving the group gives the partitions away
            self.close()
            self._stop_line("on the error below" if failed else None, held)

    def _held(self) -> list[str]:
        out = []
        for pipe in self.pipelines:
            name = f"[{pipe.name}] " if pipe.name else ""
            if self.views and pipe.counter:
                out += [name + line for line in pipe.counter.held()]
                continue
            tasks = sorted(pipe.counter.tasks.items()) if pipe.counter else []
            out += [
                f"{name}partition {p} window {t.window} "
                f"with {t.events:,} events from offset {t.start}"
                for p, t in tasks
            ]
        return out

    def _stop_line(self, reason: str | None, held: list[str]) -> None:
        """What a restart finds, as the one-process service says it: the open windows of the
        repartition partitions this member counted, replayed from their starts."""
        reason = reason or ("stop requested" if self.stop_event.is_set() else "input ended or idle")
        log.info(
            "stopped (%s): member %s, %s; an open window is replayed from its start by the "
            "member counting its partition next",
            reason,
            self.instance,
            "; ".join(held) if held else "no partitions held",
        )

    def _report(self, every_s: float = 5.0) -> None:
        """Every few seconds: readiness, the intake's lag, and this member's line in
        ``<group>.panagg.members`` (what ``panagg status --group`` shows of it). Nothing in it
        depends on the events' items: partitions, who leads, readiness, message lags."""
        now = time.monotonic()
        if now - self._reported < every_s:
            return
        self._reported = now
        ready, reason = self._update_ready()
        lag = self._intake_lag()
        pipe = self.pipelines[0]
        line = {
            "member": self.instance,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time_unix": time.time(),
            "ready": ready,
            "reason": reason,
            "metrics_url": self.metrics_url,
            "intake_lag_records": lag,
            "aggregations": {
                p.name or "-": {
                    "partitions": self._owned(p),
                    "windows": self._windows(p),
                    "leads": p.leader is not None,
                }
                for p in self.pipelines
            },
        }
        try:
            self._members_producer().send(
                pipe.topics.members, key=self.instance.encode(), value=json.dumps(line).encode()
            )
        except Exception as exc:  # a report is a convenience; the next one retries
            log.debug("member report not sent (%s)", type(exc).__name__)

    def _owned(self, pipe) -> list[int]:
        if pipe.counter is None:
            return []
        return pipe.counter.owned() if self.views else sorted(pipe.counter.tasks)

    def _windows(self, pipe) -> dict[str, int]:
        if pipe.counter is None:
            return {}
        if self.views:
            return pipe.counter.windows()
        return {str(k): t.window for k, t in pipe.counter.tasks.items()}

    def _update_ready(self, every_s: float = 5.0) -> tuple[bool, str]:
        """/ready: 503 while a stage met Kafka errors in the last 2 reports, or while this
        member leads and its leader is behind (leader.py, ``_watch_queue``)."""
        now = time.monotonic()
        failing = [name for name, at in self._outage_logged.items() if now - at < 2 * every_s]
        reasons = [f"Kafka errors in {', '.join(sorted(failing))}"] if failing else []
        reasons += [
            p.leader.behind for p in self.pipelines if p.leader is not None and p.leader.behind
        ]
        reason = "; ".join(reasons)
        self._set_ready(not reasons, reason)
        return not reasons, reason

    def _set_ready(self, ready: bool, reason: str = "") -> None:
        """/ready, and ``panagg_ready``: with several aggregations the exposition is each
        pipeline's registry (labelled aggregation=NAME), so each says the member's readiness."""
        self.metrics.set_ready(ready, reason)
        for pipe in self.pipelines:
            if pipe.metrics is not self.metrics:
                pipe.metrics.set_ready(ready, reason)

    def _members_producer(self):
        if self._plain is None:
            # a report never blocks the loop (a broker away would hold send() for 60 s)
            self._plain = KafkaProducer(**self._common(), linger_ms=50, max_block_ms=1000)
            self._clients.append(self._plain)
        return self._plain

    def _intake_lag(self) -> int | None:
        """Source records not yet taken by this member's intake (over its partitions)."""
        try:
            consumer = (
                self.intake.consumer
                if self.intake is not None
                else self.pipelines[0].counter.consumer
            )
            tps = [tp for tp in consumer.assignment() if tp.topic == self.cfg.source.topic]
            if not tps:
                return 0
            ends = consumer.end_offsets(tps, timeout_ms=1000)  # never stall the loop
            behind = {
                f"{tp.topic}:{tp.partition}": max(0, ends[tp] - consumer.position(tp)) for tp in tps
            }
        except Exception:
            return None
        for m in {id(p.metrics): p.metrics for p in self.pipelines}.values():
            # the intake feeds every aggregation: each shows the same lag
            for key in self._lag_labels - set(behind):  # partitions that moved away
                m.lag.remove(key)
            for key, n in behind.items():
                m.lag.labels(partition=key).set(n)
        self._lag_labels = set(behind)
        return int(sum(behind.values()))

    def _stage(self, name: str, pipe, step, *args) -> int:
        """One stage's turn; a Kafka error (the broker away, a rebalance under way) costs the
        turn, never the member: each stage starts again from what Kafka committed."""

        try:
            return step(*args) or 0
        except KafkaError as exc:
            now = time.monotonic()
            if now - self._outage_logged.get(name, -1e9) > 10:
                self._outage_logged[name] = now
                log.warning(
                    "%s: %s; retrying (each stage resumes from what Kafka committed)",
                    name,
                    type(exc).__name__,
                )
            if name == "counting":
                pipe.counter._needs_sync = True
            elif name == "leading":
                pipe.drop_leader()
            time.sleep(0.2)
            return 0

    def discard(self, *clients) -> None:
        """Close ``clients`` and forget them (a leader's, when it stops leading)."""
        for client in clients:
            _close_client(client)
            if client in self._clients:
                self._clients.remove(client)

    def close(self) -> None:
        for txn in self._txns:
            txn.close()
        self._txns = []
        for client in reversed(self._clients):
            _close_client(client)
        self._clients = []
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _checked(check, client, **kw) -> None:
    """``check`` (consumers.kafka.compat) on a new client: a kafka-python without the parts the
    group patches stops the start with one line (a KafkaConnectError, as the CLI prints)."""
    try:
        check(client, **kw)
    except compat.KafkaPythonIncompatible as exc:
        raise KafkaConnectError(str(exc)) from None


def _close_client(client) -> None:
    """Close a consumer or producer without waiting on a broker that is away."""

    if isinstance(client, KafkaProducer):
        close_producer(client)
        return
    try:
        client.close()
    except Exception:
        pass
