"""The shuffler of the shuffle model: ``panagg shuffle`` (docs/shuffle.md, "The shuffler").

Client topic -> (dedupe, collect a whole window, top up, strip, permute) -> analyzer topic.

What it does with a window
--------------------------
1. Reads client records (:mod:`.shuffle_wire`: key = a random 16-byte event id, value = the
   event's sealed boxes). A record whose id was already taken in this window or in one of the
   last :data:`RECENT_WINDOWS` committed windows is a redelivery and is dropped (counted). A
   malformed record goes to the dead-letter topic with a reason (never its content).
2. Closes the window at ``n`` events (count windows) or after ``window.size`` seconds (time
   windows), then adds one ``noise_only()`` output, sealed to the analyzer's key, for each
   missing event, so the analyzer's noise stays exactly DLap(p) (docs/shuffle.md, "Short
   windows"); count windows never need it.
3. Flattens every box of the window, permutes them with the OS CSPRNG
   (``random.SystemRandom().shuffle``: Fisher-Yates on ``os.urandom``), and writes them as
   chunks with no key, no headers and one timestamp (the window's close), then the end marker
   with the randomizer parameters. Keys, client timestamps, headers, partitions and event
   boundaries stop here.

Exactly once: Kafka transactions
--------------------------------
The order of a window's commit, in one transaction (``transactional_id`` per shuffler):

1. produce the chunks, the end marker and the window's dead letters;
2. ``send_offsets_to_transaction``: the client-topic offsets just past the last record of this
   window (records read beyond it stay buffered and are read again after a crash);
3. ``commit_transaction``: output and consumed offsets become visible together
   (the analyzer reads with ``isolation_level = read_committed``);
4. only then the local state file (next window id, recent event ids) is replaced.

A kill anywhere before 3 aborts the window (its records are read again from the committed
offsets); a kill between 3 and 4 leaves the local file one window behind, which the restart
detects from the committed offsets (the file records the offsets each window ended at) and
repairs. ``init_transactions`` fences any older instance with the same ``transactional_id``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import deque
from pathlib import Path

from .shuffle_wire import (WireError, chunk_record, end_record, load_public_key, parse_client_record,
                           seal_rows)

log = logging.getLogger("panagg.shuffle")

RECENT_WINDOWS = 4          # committed windows whose event ids still catch redeliveries
CHUNK_BOXES = 5_000         # boxes per analyzer record (~300 KB)
STATE_FILE = "shuffler.json"


class ShufflerError(RuntimeError):
    """A condition the operator must fix (one line)."""


def make_randomizer(cfg: dict):
    """The randomizer every client, the shuffler and the analyzer of ``cfg`` share."""
    from ..shuffle import BalcerCheuRandomizer, GKMPRandomizer
    from .config import shuffle_n
    from .process import choose_buckets_for

    st, sh = cfg["state"], cfg["shuffle"]
    buckets = int(st["domain_size"]) if st["mode"] == "direct" else choose_buckets_for(cfg)
    n = shuffle_n(cfg)
    if sh["protocol"] == "gkmp":
        return GKMPRandomizer(float(st["epsilon"]), float(sh["delta"]), n, buckets,
                              gamma=float(sh["gamma"]))
    return BalcerCheuRandomizer(float(st["epsilon"]), float(sh["delta"]), n, buckets)


def params_of(cfg: dict, rz) -> dict:
    sh = cfg["shuffle"]
    return {"protocol": sh["protocol"], "epsilon": float(cfg["state"]["epsilon"]),
            "delta": float(sh["delta"]), "n": int(rz.n), "buckets": int(rz.buckets),
            "gamma": float(sh["gamma"])}


class Shuffler:
    """One shuffler process (one consumer of the client topic, one transactional producer)."""

    def __init__(self, cfg: dict, *, state_dir: str | os.PathLike | None = None):
        sh = cfg["shuffle"]
        self.cfg = cfg
        self.client_topic = sh.get("client_topic") or ""
        self.analyzer_topic = sh.get("analyzer_topic") or cfg["source"]["topic"]
        if not self.client_topic:
            raise ShufflerError("panagg shuffle needs shuffle.client_topic (the topic clients "
                                "produce to)")
        if not self.analyzer_topic:
            raise ShufflerError("panagg shuffle needs shuffle.analyzer_topic (or source.topic): "
                                "the topic the analyzer reads")
        if not sh.get("public_key"):
            raise ShufflerError("panagg shuffle needs shuffle.public_key: the analyzer's public key "
                                "(hex, or a file), printed by `panagg shuffle-keygen`")
        try:
            self.public_key = load_public_key(str(sh["public_key"]))
        except WireError as exc:
            raise ShufflerError(f"shuffle.public_key: {exc}") from None
        self.randomizer = make_randomizer(cfg)
        self.params = params_of(cfg, self.randomizer)
        self.n = self.randomizer.n
        self.count_window = cfg["window"]["kind"] == "count"
        self.window_s = float(cfg["window"]["size"]) if not self.count_window else None
        self.dir = Path(state_dir or sh.get("shuffler_dir") or
                        Path(cfg["checkpoint"]["dir"]) / "shuffler")
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.group = sh.get("group") or "panagg-shuffler"
        self.txn_id = sh.get("transactional_id") or f"{self.group}-{self.analyzer_topic}"
        self.dead_topic = cfg["source"].get("dead_letter_topic") or ""
        self._rand = random.SystemRandom()
        self.stats = {"events": 0, "windows": 0, "duplicates": 0, "dead_letters": 0, "topped_up": 0}
        self._consumer = self._producer = None
        self._load_state()

    # -- local state --------------------------------------------------------------------------
    def _load_state(self) -> None:
        path = self.dir / STATE_FILE
        if path.exists():
            doc = json.loads(path.read_text())
        else:
            doc = {"next_window": 0, "recent": []}
        self.next_window = int(doc["next_window"])
        # recent: [{"window": k, "ends": {"partition": next offset}, "ids": [hex...]}, ...]
        self.recent = list(doc["recent"])

    def _save_state(self) -> None:
        doc = {"next_window": self.next_window, "recent": self.recent[-RECENT_WINDOWS:]}
        tmp = self.dir / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(doc, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.dir / STATE_FILE)

    def _repair_state(self, committed: dict[int, int]) -> None:
        """Reconcile the file with Kafka's committed offsets. The file is written after each
        commit, so it can only be one window behind (a kill between steps 3 and 4)."""
        last_ends = {int(p): int(o) for p, o in self.recent[-1]["ends"].items()} if self.recent else {}
        ahead = {p: o for p, o in committed.items() if o > last_ends.get(p, 0)}
        if not ahead:
            return
        if not self.recent and not (self.dir / STATE_FILE).exists():
            raise ShufflerError(
                f"the shuffler's state file {self.dir / STATE_FILE} is missing but group "
                f"{self.group!r} has committed offsets on {self.client_topic!r}: restore the "
                "shuffler's directory, or start a new shuffle.group with a new analyzer topic")
        log.warning("window %d was committed to Kafka but not to %s (stopped between the two): "
                    "continuing with window %d; redeliveries of its events are no longer caught",
                    self.next_window, STATE_FILE, self.next_window + 1)
        self.recent.append({"window": self.next_window, "ends": {str(p): o for p, o in committed.items()},
                            "ids": []})
        self.next_window += 1
        self._save_state()

    # -- Kafka clients ------------------------------------------------------------------------
    def _clients(self):
        from kafka import KafkaConsumer, KafkaProducer, TopicPartition

        from consumers.kafka_security import client_options

        sec = client_options(self.cfg.get("security"))
        boot = self.cfg["source"]["bootstrap"]
        self._consumer = KafkaConsumer(bootstrap_servers=boot, group_id=self.group,
                                       enable_auto_commit=False, auto_offset_reset="earliest",
                                       isolation_level="read_committed",
                                       allow_auto_create_topics=False, **sec)
        parts = self._consumer.partitions_for_topic(self.client_topic)
        if not parts:
            raise ShufflerError(f"client topic {self.client_topic!r} does not exist on {boot}; "
                                "create it (the shuffler never creates topics)")
        self._tps = [TopicPartition(self.client_topic, p) for p in sorted(parts)]
        self._consumer.assign(self._tps)
        committed = {}
        for tp in self._tps:
            off = self._consumer.committed(tp)
            committed[tp.partition] = int(off) if off is not None else 0
            self._consumer.seek(tp, committed[tp.partition])
        self._repair_state(committed)
        self._producer = KafkaProducer(bootstrap_servers=boot, transactional_id=self.txn_id,
                                       acks="all", max_request_size=16 * 1024 * 1024, **sec)
        self._producer.init_transactions()  # fences an older instance with the same id
        log.info("shuffling %s -> %s (%s, n = %d, %d buckets, %.1f messages/event expected); "
                 "next window %d", self.client_topic, self.analyzer_topic,
                 self.params["protocol"], self.n, self.params["buckets"],
                 self.randomizer.expected_messages, self.next_window)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, *, idle_exit_s: float | None = None, max_windows: int | None = None) -> None:
        self._clients()
        buffer: deque = deque()           # (partition, offset, key, value) read, not yet windowed
        events: list = []                 # (event id, boxes) of the open window
        ids: set = set()
        dead: list = []                   # (reason, partition, offset) of the open window
        ends: dict[int, int] = {}         # next offset per partition consumed into the window
        seen_recent = {i for w in self.recent for i in w["ids"]}
        started = time.monotonic()
        last_data = time.monotonic()
        done = 0
        while max_windows is None or done < max_windows:
            if not buffer:
                got = self._consumer.poll(timeout_ms=500, max_records=5000)
                for tp, recs in got.items():
                    for r in recs:
                        buffer.append((tp.partition, r.offset, r.key, r.value))
                if buffer:
                    last_data = time.monotonic()
            while buffer and (not self.count_window or len(events) < self.n):
                part, off, key, value = buffer.popleft()
                ends[part] = off + 1
                eid = bytes(key).hex() if key else ""
                if not key or len(key) != 16:
                    dead.append(("no_event_id", part, off, key, value))
                    continue
                if eid in ids or eid in seen_recent:
                    self.stats["duplicates"] += 1
                    continue
                try:
                    boxes = parse_client_record(value)
                except WireError as exc:
                    log.warning("client record %s:%s@%s: %s", self.client_topic, part, off, exc)
                    dead.append(("malformed", part, off, key, value))
                    continue
                ids.add(eid)
                events.append((eid, boxes))
            full = self.count_window and len(events) >= self.n
            timed = (not self.count_window and time.monotonic() - started >= self.window_s)
            if full or timed:
                self._commit_window(events, dead, ends)
                seen_recent = {i for w in self.recent for i in w["ids"]}
                events, ids, dead = [], set(), []
                started = time.monotonic()
                done += 1
                continue
            if idle_exit_s is not None and not buffer and time.monotonic() - last_data > idle_exit_s:
                log.info("no client records for %.0f s: stopping with %d event(s) in the open "
                         "window (read again at the next start)", idle_exit_s, len(events))
                break
        self.close()

    def _commit_window(self, events, dead, ends) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        wid = self.next_window
        missing = self.n - len(events) if not self.count_window else 0
        if missing < 0:  # time windows never take more than n: refuse loudly
            raise ShufflerError(f"window {wid} has {len(events)} events, more than shuffle.n = "
                                f"{self.n}; raise shuffle.n or shorten window.size")
        boxes = [b for _, bs in events for b in bs]
        for _ in range(missing):
            boxes.extend(seal_rows(self.randomizer.noise_only(), self.public_key))
        self._rand.shuffle(boxes)
        stamp = int(time.time() * 1000)
        p = self._producer
        p.begin_transaction()
        # 1. the window's output
        for i in range(0, len(boxes), CHUNK_BOXES):
            p.send(self.analyzer_topic, value=chunk_record(wid, boxes[i:i + CHUNK_BOXES]),
                   partition=0, timestamp_ms=stamp)
        p.send(self.analyzer_topic, value=end_record(wid, len(events), missing, len(boxes),
                                                     params=self.params),
               partition=0, timestamp_ms=stamp)
        for reason, part, off, key, value in dead:
            if self.dead_topic:
                p.send(self.dead_topic, key=key, value=value,
                       headers=[("reason", reason.encode()), ("source", f"{part}@{off}".encode())])
            log.warning("client record %s:%s@%s to dead letters%s: %s", self.client_topic, part,
                        off, "" if self.dead_topic else " (none configured: dropped)", reason)
        # 2. the consumed offsets, in the same transaction
        offsets = {TopicPartition(self.client_topic, part): OffsetAndMetadata(off, "", -1)
                   for part, off in ends.items()}
        if offsets:
            p.send_offsets_to_transaction(offsets, self.group)
        # 3. output and offsets visible together
        p.commit_transaction()
        # 4. the local file, only after Kafka committed
        self.recent.append({"window": wid, "ends": {str(k): v for k, v in ends.items()},
                            "ids": [e for e, _ in events]})
        self.recent = self.recent[-RECENT_WINDOWS:]
        self.next_window = wid + 1
        self._save_state()
        self.stats["events"] += len(events)
        self.stats["windows"] += 1
        self.stats["dead_letters"] += len(dead)
        self.stats["topped_up"] += missing
        log.info("window %d: %d events%s, %d messages shuffled to %s", wid, len(events),
                 f" + {missing} topped up" if missing else "", len(boxes), self.analyzer_topic)

    def close(self) -> None:
        for c in (self._consumer, self._producer):
            if c is not None:
                try:
                    c.close()
                except Exception:  # closing is best effort
                    pass
        self._consumer = self._producer = None
