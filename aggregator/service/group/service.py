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

import logging
import math
import os
import socket
import threading
import time
import uuid

import numpy as np

from consumers.decode import Decoder, ItemSpec
from consumers.kafka_security import client_options

from ...hashing import bucket_of
from ..ledger import LedgerError
from ..process import ServiceError, choose_buckets_for, release_method
from .counter import Counter
from .leader import Leader
from .ledger_topic import TopicLedger
from .repartition import Repartitioner
from .topics import GroupTopicError, GroupTopics
from .txn import Transactions

__all__ = ["GroupService", "MUST_AGREE"]

log = logging.getLogger("panagg.group")

#: identity fields every member must share with the group
MUST_AGREE = ("mode", "size", "epsilon", "neighbor", "model", "window_size", "partitions")
_NAMES = {"mode": "state.mode", "size": "state.domain_size / state.buckets",
          "epsilon": "state.epsilon", "neighbor": "the neighbour relation",
          "model": "state.model", "window_size": "window.size", "partitions": "scale.partitions"}


class GroupService:
    """One member of the group ``source.group`` (see the module docstring)."""

    def __init__(self, cfg: dict, metrics, *, fresh_start: bool = False,
                 accept_change: bool = False):
        if fresh_start or accept_change:
            raise ServiceError("--fresh-start and --accept-change do not apply to scale.store = "
                               "kafka: the group's state is its Kafka topics (use another "
                               "source.group for a new group)")
        self.cfg, self.metrics = cfg, metrics
        src, st = cfg["source"], cfg["state"]
        self.direct = st["mode"] == "direct"
        self.size = int(st["domain_size"]) if self.direct else choose_buckets_for(cfg)
        self.topics = GroupTopics(src["group"])
        self.instance = src["instance_id"] or \
            f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.security = client_options(cfg.get("security"))
        self.decoder = Decoder(src["format"], domain_size=self.size if self.direct else None,
                               max_message_bytes=src["max_message_bytes"],
                               max_item_bytes=src["max_item_bytes"],
                               spec=ItemSpec.from_config(cfg["item"]))
        self.stop_event = threading.Event()
        self.on_started = None
        self.worker = None
        self.identity: dict | None = None
        self.leader: Leader | None = None
        self._clients: list = []
        self._txns: list[Transactions] = []
        self._outage_logged: dict[str, float] = {}

    # -- Kafka clients -----------------------------------------------------------------------
    def _common(self) -> dict:
        return dict(bootstrap_servers=self.cfg["source"]["bootstrap"],
                    reconnect_backoff_max_ms=1000, **self.security)

    def _consumer(self, group: str | None, **extra):
        from kafka import KafkaConsumer

        src = self.cfg["source"]
        conf = dict(self._common(), group_id=group, enable_auto_commit=False,
                    isolation_level="read_committed", auto_offset_reset="earliest",
                    client_id=f"panagg-{self.instance}",
                    fetch_max_bytes=src["fetch_max_bytes"],
                    max_partition_fetch_bytes=src["max_partition_fetch_bytes"])
        if group is not None:
            conf.update(session_timeout_ms=int(src["session_timeout_s"] * 1000),
                        heartbeat_interval_ms=int(min(3.0, src["session_timeout_s"] / 3) * 1000))
        conf.update(extra)
        c = KafkaConsumer(**conf)
        self._clients.append(c)
        return c

    def _producer(self, transactional_id: str, keep: bool = True):
        from kafka import KafkaProducer

        p = KafkaProducer(**self._common(), transactional_id=transactional_id,
                          transaction_timeout_ms=15000, linger_ms=5,
                          max_request_size=16 * 1024 * 1024)
        try:
            p.init_transactions()
        except Exception:
            p.close(timeout=5)
            raise
        if keep:
            self._clients.append(p)
        return p

    def _transactions(self, transactional_id: str) -> Transactions:
        txn = Transactions(lambda: self._producer(transactional_id, keep=False))
        self._txns.append(txn)
        return txn

    # -- start -------------------------------------------------------------------------------
    def _partitions(self, admin) -> int:
        src = self.cfg["source"]
        want = int(self.cfg["scale"]["partitions"])
        found = [d for d in admin.describe_topics([src["topic"]])
                 if d.get("topic", d.get("name")) == src["topic"]]
        have = len(found[0].get("partitions") or []) if found else 0
        if not have:
            raise ServiceError(f"topic {src['topic']!r} does not exist on the cluster: create it "
                               "(panagg reads it, never creates it) or fix source.topic")
        return want or have

    def _identity_of_config(self, partitions: int) -> dict:
        st, w = self.cfg["state"], self.cfg["window"]
        from ...state import PanPrivateHistogram
        neighbor = PanPrivateHistogram(st["epsilon"], size=1).neighbor
        return {"mode": st["mode"], "size": self.size, "epsilon": float(st["epsilon"]),
                "neighbor": neighbor, "model": st["model"], "window_size": float(w["size"]),
                "partitions": int(partitions)}

    def start(self) -> None:
        from kafka.admin import KafkaAdminClient

        cfg = self.cfg
        admin = KafkaAdminClient(**self._common(), request_timeout_ms=int(
            cfg["source"]["connect_timeout_s"] * 1000))
        try:
            P = self._partitions(admin)
            retention = cfg["scale"]["repartition_retention_s"] or \
                max(3 * float(cfg["window"]["size"]), 3600.0)
            for line in self.topics.ensure(admin, P, int(retention * 1000)):
                log.info(line)
        except GroupTopicError as exc:
            raise ServiceError(str(exc)) from None
        finally:
            admin.close()
        budget = cfg["ledger"]["budget_per_window"] or float(cfg["state"]["epsilon"])
        self.ledger = TopicLedger(self._consumer(None), self.topics.ledger,
                                  budget_per_window=budget,
                                  budget_total=cfg["ledger"]["budget_total"] or None,
                                  budget_per_event=cfg["ledger"].get("budget_per_event") or budget)
        try:
            self.ledger.read_to_end()
            self.identity = self.ledger.identity() or self._write_identity(P)
        except LedgerError as exc:
            raise ServiceError(str(exc)) from None
        self._check_identity(self._identity_of_config(P))
        if cfg["release"]["workers"]:
            from ..release_worker import ReleaseWorker
            self.worker = ReleaseWorker(cfg["release"]["workers"])
        group_opts = {"group_instance_id": self.instance} if cfg["source"]["instance_id"] else {}
        self.counter = Counter(self._consumer(self.topics.counting_group, **group_opts),
                               self._transactions(f"{self.topics.group}.panagg.count."
                                                  f"{self.instance}"),
                               self.topics, self.identity, self.ledger, self.metrics,
                               member=self.instance, grace_s=cfg["scale"]["close_grace_s"])
        intake = self._consumer(cfg["source"]["group"], **group_opts,
                                max_poll_records=cfg["source"]["max_records"])
        intake.subscribe([cfg["source"]["topic"]])
        self.intake = Repartitioner(
            intake, self._transactions(f"{self.topics.group}.panagg.intake.{self.instance}"),
            self.topics.repartition, P, self.decoder, self._index_of(), self.metrics,
            max_records=cfg["source"]["max_records"])
        self.metrics.epsilon.set(float(cfg["state"]["epsilon"]))
        log.info("member %s of group %s: %d partition(s), %s mode with %d counters split into "
                 "%d slices, windows of %g s by intake time; shared state only in %s.panagg.*",
                 self.instance, self.topics.group, P, self.identity["mode"], self.size, P,
                 self.identity["window_size"], self.topics.group)

    def _index_of(self):
        if self.direct:
            return lambda items: np.asarray(items, dtype=np.int64)
        key = bytes.fromhex(self.identity["hash_key"])
        return lambda items: bucket_of(items, key, self.size)

    def _write_identity(self, partitions: int) -> dict:
        """The group is new: write its identity as the ledger's first entry (leader's id)."""
        producer = self._producer(f"{self.topics.group}.panagg.leader")  # fences any other
        try:
            self.ledger.read_to_end()
            if self.ledger.identity():      # another member was first
                return self.ledger.identity()
            ident = self._identity_of_config(partitions)
            ident.update(first_window=int(math.floor(time.time() / ident["window_size"])),
                         lineage=f"{self.topics.group}:{uuid.uuid4().hex[:12]}")
            if not self.direct:
                ident["hash_key"] = os.urandom(16).hex()
            producer.begin_transaction()
            self.ledger.append(entry_id="identity", kind="identity", identity=ident,
                               producer=producer)
            producer.commit_transaction()
            self.ledger.committed()
            log.info("new group %s: identity written to %s", self.topics.group,
                     self.topics.ledger)
            return ident
        finally:
            producer.close()
            self._clients.remove(producer)

    def _check_identity(self, mine: dict) -> None:
        bad = [k for k in MUST_AGREE if self.identity.get(k) != mine[k]]
        if bad:
            k = bad[0]
            raise ServiceError(
                f"group {self.topics.group} was started with {_NAMES[k]} = {self.identity[k]!r}, "
                f"this member has {mine[k]!r}: start every member with the group's settings, or "
                "use another source.group for a new group")

    # -- the loop ----------------------------------------------------------------------------
    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.1) -> None:
        try:
            self.start()
        except Exception:
            self.close()
            raise
        self.metrics.set_ready(True)
        if self.on_started is not None:
            self.on_started()
        idle_since = time.monotonic()
        try:
            while not self.stop_event.is_set():
                took = self._stage("intake", self.intake.step, poll_timeout_s)
                counted = self._stage("counting", self.counter.step, poll_timeout_s)
                self._stage("leading", self._lead)
                if took or counted:
                    idle_since = time.monotonic()
                elif idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s:
                    break
        finally:
            self.close()

    def _stage(self, name: str, step, *args) -> int:
        """One stage's turn; a Kafka error (the broker away, a rebalance under way) costs the
        turn, never the member: each stage starts again from what Kafka committed."""
        from kafka.errors import KafkaError

        try:
            return step(*args) or 0
        except KafkaError as exc:
            now = time.monotonic()
            if now - self._outage_logged.get(name, -1e9) > 10:
                self._outage_logged[name] = now
                log.warning("%s: %s; retrying (each stage resumes from what Kafka committed)",
                            name, type(exc).__name__)
            if name == "counting":
                self.counter._needs_sync = True
            elif name == "leading" and self.leader is not None:
                self._drop_leader()
            time.sleep(0.2)
            return 0

    def _lead(self) -> None:
        if self.counter.is_leader and self.leader is None:
            self.leader = self._make_leader()
        elif not self.counter.is_leader and self.leader is not None:
            log.info("the ledger's partition moved to another member: no longer the leader")
            self._drop_leader()
        if self.leader is None:
            return
        self.leader.step()

    def _make_leader(self) -> Leader:
        cfg = self.cfg
        producer = self._producer(f"{self.topics.group}.panagg.leader")   # fences the last one
        self.ledger.read_to_end()
        log.info("leading group %s: this member charges the ledger and merges the windows",
                 self.topics.group)
        merge = None
        if self.worker is not None:
            from ..partitioned import merge_summaries
            worker = self.worker
            merge = lambda summaries, **kw: worker.call(merge_summaries, summaries, **kw)  # noqa: E731
        return Leader(producer, self.ledger, self._consumer(None), self.topics, self.identity,
                      self.metrics, release_dir=cfg["release"]["dir"],
                      release_topic=cfg["release"]["topic"], loss=cfg["state"]["loss"],
                      error_bar_reps=cfg["release"]["error_bar_reps"],
                      method=release_method(cfg), merge=merge,
                      grace_s=cfg["scale"]["close_grace_s"])

    def _drop_leader(self) -> None:
        leader, self.leader = self.leader, None
        for client in (leader.producer, leader.summaries):
            try:
                client.close()
            except Exception:
                pass
            if client in self._clients:
                self._clients.remove(client)

    def close(self) -> None:
        for txn in self._txns:
            txn.close()
        self._txns = []
        for client in reversed(self._clients):
            try:
                client.close()
            except Exception:
                pass
        self._clients = []
        if self.worker is not None:
            self.worker.close()
            self.worker = None
