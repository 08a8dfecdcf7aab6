"""One aggregation of a Kafka-only group: its topics, ledger, identity, counting and leading.

A group counts one item (``[state]``, ``[item]``), or several (``[aggregations.NAME]``); each
aggregation is a :class:`Pipeline` with its own internal topics (``<group>.panagg[.NAME].*``),
its own ledger and identity, its own counting consumer group (so the group assigns each
aggregation's ledger partition, and with it the leadership, on its own) and its own release
directory. The intake reads the source once for all of them
(:class:`~aggregator.service.group.repartition.Repartitioner` with one route each).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from types import SimpleNamespace

import numpy as np
from kafka.errors import KafkaError

from consumers.decode import Decoder, ItemSpec
from consumers.kafka_security import client_options
from state_store.registry import KafkaBudgetRegistry, RegistryError

from ...hashing import bucket_of
from ...state import PanPrivateHistogram
from ..config import parse_start, rollup_spans
from ..errors import ServiceError
from ..identity import choose_buckets_for
from ..ledger import LedgerError
from ..settings import Config, settings_by
from ..stages.release import release_method
from .closer import Closer
from .count_windows import CountCloser
from .counter import Counter
from .export import ExportCollector
from .forced import ReleaseRequests
from .leader import Leader
from .ledger_topic import LedgerUnreachable, TopicLedger
from .repartition import EventClock, Route
from .rollups import RollupReleases, SliceRollups
from .summary import merge_summaries
from .topics import GroupTopics, latest_values
from .txn import Transactions
from .view_rollups import ViewRollups
from . import view_format
from .views import ViewCounter

__all__ = ["Pipeline", "MUST_AGREE"]

log = logging.getLogger("panagg.group")

#: the agreement keys that are no setting: the neighbour relation of the state's noise
_NOT_SETTINGS = {"neighbor": "the neighbour relation"}
#: the settings of each key of the group's identity every member must share with the group
#: (settings.py, ``agree=``; the keys are the group ledger's, older than the settings' names)
_AGREED = settings_by("agree")
MUST_AGREE = (*_AGREED, *_NOT_SETTINGS)
_NAMES = {
    **{key: " / ".join(one.name for one in fed) for key, fed in _AGREED.items()},
    **_NOT_SETTINGS,
}
#: what an identity written before event-time windows existed in groups means
_IDENTITY_DEFAULTS = {
    "window_kind": "time",
    "allowed_lateness_s": 0.0,
    "late": "next",
    "exchange": "items",
}


class Pipeline:
    """Aggregation ``name`` ("" for a group of one) with its config ``cfg``; ``clients`` is the
    member (:class:`~aggregator.service.group.service.GroupService`) that makes Kafka clients."""

    def __init__(self, name: str, cfg: Config, clients, metrics):
        self.name, self.cfg, self.clients, self.metrics = name, cfg, clients, metrics
        st, src = cfg.state, cfg.source
        self.direct = st.mode == "direct"
        #: scale.exchange = views: members count their own source partitions (views.py)
        self.views = cfg.scale.exchange == "views"
        self.size = int(st.domain_size) if self.direct else choose_buckets_for(cfg)
        self.topics = GroupTopics(src.group, name)
        self.decoder = Decoder(
            src.format,
            domain_size=self.size if self.direct else None,
            max_message_bytes=src.max_message_bytes,
            max_item_bytes=src.max_item_bytes,
            spec=ItemSpec.from_config(cfg.item),
        )
        self.identity: dict | None = None
        self.ledger: TopicLedger | None = None
        self.counter: Counter | None = None
        self.leader: Leader | None = None
        self.about = f"aggregation {name} of group {src.group}" if name else f"group {src.group}"

    # -- start -------------------------------------------------------------------------------
    def identity_of_config(self, partitions: int) -> dict:
        st, w = self.cfg.state, self.cfg.window
        neighbor = PanPrivateHistogram(st.epsilon, size=1).neighbor
        event_time = w.kind == "event_time"
        return {
            "mode": st.mode,
            "size": self.size,
            "epsilon": float(st.epsilon),
            "neighbor": neighbor,
            "model": st.model,
            "window_size": float(w.size),
            "partitions": int(partitions),
            "window_kind": w.kind if w.kind in ("event_time", "count") else "time",
            "allowed_lateness_s": float(w.allowed_lateness_s),
            "late": w.late if event_time else "next",
            "exchange": self.cfg.scale.exchange,
        }

    def anchor(self, admin) -> dict | None:
        """The newest ledger head the counting group's committed offsets carry (None: none)."""
        got = (
            admin.list_group_offsets(self.topics.counting_group).get(self.topics.counting_group, {})
            or {}
        )
        best = None
        for om in got.values():
            try:
                seq, _, h = str(json.loads(om.metadata or "{}").get("lh", "")).partition(":")
            except ValueError:
                continue
            if seq.isdigit() and (best is None or int(seq) > best["seq"]):
                best = {"seq": int(seq), "hash": h}
        return best

    def open_ledger(self, partitions: int, anchor: dict | None = None, seed=None) -> None:
        """Read the ledger; check it against ``anchor``; write the identity if the group is
        new (with ``seed(txn)``'s messages in the same transaction: where a new group starts
        reading, ``source.start``), else check this member's settings against it."""
        cfg = self.cfg
        self.ledger = TopicLedger(
            self.clients.consumer(None),
            self.topics.ledger,
            budget_per_window=cfg.budget_per_window,
            budget_total=cfg.ledger.budget_total or None,
            budget_per_event=cfg.budget_per_event,
        )
        try:
            self.ledger.read_to_end()
            problem = self.ledger.anchor_problem(anchor)
            if problem:
                raise LedgerError(
                    f"{problem}; the ledger is the record of privacy spent: "
                    "restore the topic, or start a new group (another "
                    "source.group) knowing the old charges are not carried over"
                )
            self.identity = self.ledger.identity() or self._write_identity(partitions, seed)
        except LedgerUnreachable:
            raise  # the broker is away: the start is tried again (service.py)
        except LedgerError as exc:
            raise ServiceError(str(exc)) from None
        self.check_identity(self.identity_of_config(partitions))
        self._check_start()

    def _check_start(self) -> None:
        """``source.start`` only places a new group; a member asking another start of a group
        that has one would be silently ignored (it resumes from the group's offsets): refused."""

        wanted = self.cfg.source.start
        had = self.identity.get("start", "earliest")
        if parse_start(wanted) != "earliest" and parse_start(had) != parse_start(wanted):
            raise ServiceError(
                f"source.start = {wanted} only places a new group, but "
                f"{self.about} exists (it started at {had}) and resumes from its "
                f"committed offsets; for a new start at {wanted} use another "
                "source.group, or remove source.start"
            )

    def _write_identity(self, partitions: int, seed=None) -> dict:
        """The group is new: write its identity as the ledger's first entry (with the leader's
        transactional id, so two members starting at once write one identity)."""
        txn = Transactions(
            lambda: self.clients.producer(f"{self.topics.prefix}.leader", keep=False), remake=False
        )
        try:
            self.ledger.read_to_end()
            if self.ledger.identity():  # another member was first
                return self.ledger.identity()
            ident = self.identity_of_config(partitions)
            # (event-time windows: informational; the leader opens them at the source
            # partitions' earliest first record, closer.py)
            count = ident["window_kind"] == "count"
            # (count windows are numbered from 0: the leader cuts them, count_windows.py)
            ident.update(
                first_window=0 if count else int(math.floor(time.time() / ident["window_size"])),
                lineage=f"{self.topics.prefix}:{uuid.uuid4().hex[:12]}",
            )
            if self.name:
                ident["aggregation"] = self.name
            if not self.direct:
                ident["hash_key"] = os.urandom(16).hex()
            ident["start"] = str(self.cfg.source.start)
            txn.begin()
            self.ledger.append(entry_id="identity", kind="identity", identity=ident, producer=txn)
            if seed is not None:
                seed(txn)
            txn.commit()
            self.ledger.committed()
            log.info("new %s: identity written to %s", self.about, self.topics.ledger)
            return ident
        except KafkaError as exc:
            self.ledger.aborted()
            # a member fenced by another one writing the identity at the same instant (its
            # next start try reads that identity: service.py) says so, not "KafkaError"
            cause = txn.cause(exc)
            if cause is not exc:
                raise cause from None
            raise
        except Exception:
            self.ledger.aborted()
            raise
        finally:
            txn.close()

    def check_identity(self, mine: dict) -> None:
        def theirs(k):
            return self.identity.get(k, _IDENTITY_DEFAULTS.get(k))

        bad = [k for k in MUST_AGREE if theirs(k) != mine[k]]
        if bad:
            k = bad[0]
            raise ServiceError(
                f"{self.about} was started with {_NAMES[k]} = {theirs(k)!r}, this member "
                f"has {mine[k]!r}: start every member with the group's settings, or use another "
                "source.group for a new group"
            )

    def index_of(self):
        """The counter index of each decoded item: the item (direct), or its hash bucket under
        the group's key."""
        if self.direct:
            return lambda items: np.asarray(items, dtype=np.int64)
        key, size = bytes.fromhex(self.identity["hash_key"]), self.size
        return lambda items: bucket_of(items, key, size)

    def route(self, partitions: int) -> Route:
        return Route(
            self.topics.repartition,
            partitions,
            self.decoder,
            self.index_of(),
            self.metrics,
            clock=self.clock(),
            name=self.name,
            dead_topic=self.cfg.source.dead_letter_topic,
            counted=self.identity.get("window_kind") == "count",
        )

    def clock(self) -> EventClock | None:
        """The event-time windows of this aggregation (None: by intake time)."""
        if self.identity.get("window_kind", "time") != "event_time":
            return None
        w = self.cfg.window
        return EventClock(
            size_s=self.identity["window_size"],
            lateness_s=self.identity["allowed_lateness_s"],
            max_future_skew_s=w.max_future_skew_s,
            late=self.identity["late"],
            idle_timeout_s=w.idle_partition_timeout_s,
        )

    def rollup_spans(self) -> dict[str, int]:
        """window.rollups as sums (rollup_design = sum, or a hybrid level's longer spans)."""
        return rollup_spans(self.cfg)

    def start_counting(self, instance: str, group_opts: dict) -> None:
        if self.views:
            cfg = self.cfg
            self.counter = ViewCounter(
                self.clients.consumer(
                    self.topics.counting_group,
                    **group_opts,
                    max_poll_records=cfg.source.max_records,
                ),
                self.clients.transactions(f"{self.topics.prefix}.count.{instance}"),
                self.topics,
                self.identity,
                self.ledger,
                self.metrics,
                member=instance,
                source_topic=cfg.source.topic,
                route=self.route(int(self.identity["partitions"])),
                closes=self.clients.consumer(None),
                snapshots_per_window=cfg.checkpoint.snapshots_per_window,
                snapshot_reader=SimpleNamespace(
                    consumer=self.clients.consumer(None), topic=self.topics.snapshots
                )
                if cfg.checkpoint.snapshots_per_window
                else None,
                views_reader=self._views_written,
            )
            return
        spans = self.rollup_spans()
        self.counter = Counter(
            self.clients.consumer(self.topics.counting_group, **group_opts),
            self.clients.transactions(f"{self.topics.prefix}.count.{instance}"),
            self.topics,
            self.identity,
            self.ledger,
            self.metrics,
            member=instance,
            grace_s=self.cfg.scale.close_grace_s,
            snapshots_per_window=self.cfg.checkpoint.snapshots_per_window,
            snapshot_reader=SimpleNamespace(
                consumer=self.clients.consumer(None), topic=self.topics.snapshots
            ),
            rollups=SliceRollups(spans, self.topics, self.identity, self.clients.consumer(None))
            if spans
            else None,
        )

    def _views_written(self) -> dict[str, bytes] | None:
        """The summaries topic's latest values (views.ViewCounter._views_written), read by a
        consumer made for it and closed after."""
        consumer = self.clients.consumer(None)
        try:
            return latest_values(consumer, self.topics.summaries)
        finally:
            self.clients.discard(consumer)

    # -- leading -----------------------------------------------------------------------------
    def lead(self) -> None:
        if self.counter.is_leader and self.leader is None:
            self.leader = self._make_leader()
        elif not self.counter.is_leader and self.leader is not None:
            log.info(
                "the ledger's partition of %s moved to another member: no longer its leader",
                self.about,
            )
            self.drop_leader()
        if self.leader is not None:
            self.leader.step()

    def _make_leader(self) -> Leader:
        cfg = self.cfg
        # a new producer with the group's fixed leader id fences the last leader
        txn = Transactions(
            lambda: self.clients.producer(f"{self.topics.prefix}.leader", keep=False), remake=False
        )
        self.ledger.read_to_end()
        log.info("leading %s: this member charges the ledger and merges the windows", self.about)
        closer = None
        clock = self.clock()
        if clock is not None and not self.views:
            # (a views group's members close their own event-time windows: event_views.py)
            closer = Closer(
                txn,
                self.clients.consumer(None),
                self.topics,
                self.identity["partitions"],
                self.clients.source_partitions,
                clock,
            )
        elif self.identity.get("window_kind") == "count" and not self.views:
            # (a views group's members cut their own windows: count_views.py)
            # (a short fetch wait: the totals' age is what a cut overshoots N by)
            closer = CountCloser(
                txn,
                self.clients.consumer(None, fetch_max_wait_ms=50),
                self.topics,
                self.identity["partitions"],
                int(self.identity["window_size"]),
            )
        merge = None
        worker = self.clients.worker
        # view_format.merge_views read here, not bound at import: the group audit captures
        # the merges by standing in for it (tests/group_audit.py)
        merge_fn = view_format.merge_views if self.views else merge_summaries
        if worker is not None:
            merge = lambda summaries, **kw: worker.call(merge_fn, summaries, **kw)  # noqa: E731
        leader = Leader(
            txn,
            self.ledger,
            self.clients.consumer(None),
            self.topics,
            self.identity,
            self.metrics,
            release_dir=cfg.release.dir,
            release_topic=cfg.release.topic,
            loss=cfg.state.loss,
            error_bar_reps=cfg.release.error_bar_reps,
            method=release_method(cfg),
            merge=merge,
            grace_s=cfg.scale.close_grace_s,
            aggregation=self.name,
            rollup_level=cfg.aggregation.rollup_level if cfg.aggregation else None,
            requests=ReleaseRequests(self.clients.consumer(None), self.topics),
            exports=ExportCollector(
                self.clients.consumer(None), self.topics, int(self.identity["partitions"])
            ),
            audit_key_file=cfg.audit.key_file,
            audit_dir=cfg.audit.dir or os.path.join(cfg.checkpoint.dir, "exports"),
            closer=closer,
            max_in_flight=cfg.release.max_in_flight,
            merge_fn=merge_fn,
            source_topic=cfg.source.topic,
        )
        spans = self.rollup_spans()
        if spans and self.views:
            leader.view_rollups = ViewRollups(leader, spans, self.clients.consumer(None))
        elif spans:
            leader.rollups = RollupReleases(leader, spans)
        if cfg.ledger.registry_topic:
            reg = KafkaBudgetRegistry(
                cfg.source.bootstrap,
                cfg.ledger.registry_topic,
                {"group": cfg.source.group, "aggregation": self.name or None},
                security=client_options(cfg.security),
                timeout_s=float(cfg.source.connect_timeout_s),
            )
            try:
                reg.open()
            except RegistryError as exc:
                raise ServiceError(str(exc)) from None
            leader.registry = reg
        return leader

    def drop_leader(self) -> None:
        leader, self.leader = self.leader, None
        self.metrics.release_queue.set(0)  # the queue is the next leader's to show
        if leader is not None:
            if leader.registry is not None:
                leader.registry.close()
            leader.txn.close()
            self.clients.discard(leader.summaries)
            if leader.requests is not None:
                self.clients.discard(leader.requests.consumer)
            if leader.exports is not None:
                self.clients.discard(leader.exports.consumer)
            if leader.closer is not None:
                self.clients.discard(leader.closer.reader)
            if leader.view_rollups is not None:
                self.clients.discard(leader.view_rollups.reader)
