"""The streaming service: source -> decode -> count -> checkpoint -> window close -> release.

Exactly once. The next offset of every source partition lives inside the checkpoint, next to the
counters that include exactly the events before it; on start the source seeks there. Kafka's own
committed offsets are only updated after a checkpoint, for lag monitoring. A crash at any instant
(including mid-checkpoint: the store writes atomically) resumes from the last checkpoint, so no
event is lost or counted twice.

Windows. Tumbling, by event count or processing time; each window starts a fresh state with fresh
noise, so each event is in one window. A window close is made durable in one atomic checkpoint
that holds the new window's state *and* the closed window's release document (computed once, with
its fresh noise layer); publishing then happens from that document, so a crash re-publishes the
same release instead of computing a second one.

Ledger. The release of window w is recorded (idempotently, by id) before that checkpoint; a
release over budget is refused. Announced audit exports are ledgered too.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from consumers.base import Segment, Source
from consumers.decode import Decoder
from state_store.audit import load_key, write_export
from state_store.local import Checkpoint, LocalStore

from .ledger import BudgetExceeded, Ledger
from .metrics import Metrics
from ..release import make_release, write_release
from ..state import PanPrivateHistogram

__all__ = ["Aggregator", "ServiceError", "choose_buckets_for"]

log = logging.getLogger("panagg.service")


class ServiceError(RuntimeError):
    """A condition that stops the service with a clear message."""


def choose_buckets_for(cfg: dict) -> int:
    """Number of hash buckets for hashed mode: configured, or from expected_n by the default rule
    of :func:`aggregator.largedomain.choose_buckets` (docs/large_domains.md, "Choosing B")."""
    if cfg["state"]["buckets"]:
        return int(cfg["state"]["buckets"])
    from ..largedomain import choose_buckets
    return int(choose_buckets(max(int(cfg["state"]["expected_n"]), 2), cfg["state"]["epsilon"]))


class Aggregator:
    """One aggregator process over one :class:`Source`.

    Parameters
    ----------
    cfg
        Configuration from :func:`aggregator.service.config.load_config`.
    source
        The event source.
    metrics
        Prometheus metrics (a fresh registry if omitted).
    """

    def __init__(self, cfg: dict, source: Source, metrics: Metrics | None = None):
        self.cfg = cfg
        self.source = source
        self.metrics = metrics or Metrics()
        st = cfg["state"]
        self.epsilon = float(st["epsilon"])
        self.model, self.loss = st["model"], st["loss"]
        self.direct = st["mode"] == "direct"
        self.size = int(st["domain_size"]) if self.direct else choose_buckets_for(cfg)
        src = cfg["source"]
        self.decoder = Decoder(src["format"], domain_size=self.size if self.direct else None,
                               max_message_bytes=src["max_message_bytes"],
                               max_item_bytes=src["max_item_bytes"])
        self.dir = Path(cfg["checkpoint"]["dir"])
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = None
        self.partitioned = bool(cfg["scale"]["partitioned"])
        # scale-out keeps one store per partition (aggregator/service/partitioned.py)
        self.store = None if self.partitioned else LocalStore(self.dir / "checkpoints")
        budget = cfg["ledger"]["budget_per_window"] or self.epsilon
        self.ledger = Ledger(self.dir / "ledger.jsonl", budget_per_window=budget,
                             budget_total=cfg["ledger"]["budget_total"] or None)
        self.control = self.dir / "control"
        self.control.mkdir(exist_ok=True)
        seed = cfg["testing"]["noise_seed"]
        self._seed = seed if seed >= 0 and os.environ.get("PANAGG_TESTING") == "1" else None
        self._producer = None
        self.state: PanPrivateHistogram | None = None
        self.window: dict = {}
        self.offsets: dict[str, int] = {}
        self.pending: list[str] = []
        self.stop_event = threading.Event()
        self._since_ckpt_events = 0
        self._last_ckpt = time.monotonic()
        self._dirty = False
        self._export_seq = 0
        self._last_lag = 0.0
        self.metrics.epsilon.set(self.epsilon)

    # -- noise sources -------------------------------------------------------------------------
    def _rng(self, *tag):
        """None (OS CSPRNG) in production; a deterministic generator only under PANAGG_TESTING."""
        if self._seed is None:
            return None
        return np.random.default_rng([self._seed, *[int(t) for t in tag]])

    def _new_state(self, window_id: int) -> PanPrivateHistogram:
        kwargs = {"size": self.size} if self.direct else {"buckets": self.size}
        return PanPrivateHistogram(self.epsilon, rng=self._rng(0, window_id), **kwargs)

    def _new_window(self, window_id: int) -> dict:
        return {"id": window_id, "kind": self.cfg["window"]["kind"],
                "size": self.cfg["window"]["size"], "events": 0, "started_unix": time.time()}

    # -- lifecycle -----------------------------------------------------------------------------
    def _lock(self) -> None:
        path = self.dir / "service.lock"
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            other = f.read().strip() or "?"
            f.close()
            raise ServiceError(f"another panagg (pid {other}) is running on checkpoint.dir "
                               f"{self.dir}; stop it or use another directory") from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f

    def save_effective_config(self) -> None:
        """Keep the running config next to the checkpoints, for offline release/export."""
        tmp = self.dir / ".config.json.tmp"
        tmp.write_text(json.dumps(self.cfg, indent=1, sort_keys=True))
        os.replace(tmp, self.dir / "config.json")

    def restore(self) -> None:
        """Load the latest checkpoint, or start window 0 with fresh noise."""
        ckpt = self.store.load_latest()
        if ckpt is None:
            self.state = self._new_state(0)
            self.window = self._new_window(0)
            self.offsets, self.pending = {}, []
            log.info("no checkpoint in %s: starting window 0", self.store.dir)
        else:
            self.state = PanPrivateHistogram.deserialize(ckpt.state)
            self.window, self.offsets, self.pending = ckpt.window, dict(ckpt.offsets), ckpt.pending
            self._check_state_matches_config(self.state, f"the checkpoint in {self.store.dir}")
            log.info("restored checkpoint %d: window %s at %d events, %d partition offsets",
                     ckpt.seq, self.window["id"], self.window["events"], len(self.offsets))
        self.metrics.window_id.set(self.window["id"])
        self.metrics.window_events.set(self.window["events"])
        self.metrics.budget_spent.set(self.ledger.spent())

    def _check_state_matches_config(self, state: PanPrivateHistogram, where: str,
                                    size: int | None = None) -> None:
        """Refuse a restored state built with other settings (``size``: the expected number of
        counters, default the configured D or B)."""
        mode = "direct" if self.direct else "hashed"
        size = self.size if size is None else size
        if (state.mode, state.size, state.epsilon) != (mode, size, self.epsilon):
            raise ServiceError(
                f"{where} holds a {state.mode} state of size {state.size} at epsilon "
                f"{state.epsilon}, but the config asks for {mode}, size {size}, epsilon "
                f"{self.epsilon}; use the original settings or a new checkpoint.dir")

    def checkpoint(self) -> None:
        self._checkpoint(self)

    def _checkpoint(self, ctx) -> None:
        """Write ``ctx``'s state, window, offsets and pending documents atomically to its store
        (the service's, or a partition's in scale-out)."""
        t0 = time.perf_counter()
        ctx.store.save(Checkpoint(state=ctx.state.serialize(), window=ctx.window,
                                  offsets=ctx.offsets, pending=ctx.pending))
        self.metrics.checkpointed(time.perf_counter() - t0)
        ctx._since_ckpt_events = 0
        ctx._last_ckpt = time.monotonic()
        ctx._dirty = False
        self.source.commit(ctx.offsets)  # lag monitoring only

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        """Consume until stopped (stop_event / SIGTERM), or until a finite source is exhausted."""
        self._lock()
        try:
            self.save_effective_config()
            self.restore()
            self.source.seek(self.offsets)
            self._publish_pending()
            idle_since = None
            while not self.stop_event.is_set():
                segments = self.source.poll(poll_timeout_s)
                for seg in segments:
                    self._ingest(seg)
                self._maybe_close_time_window()
                self._handle_control()
                if self.pending:
                    self._publish_pending()
                if self._checkpoint_due(self):
                    self.checkpoint()
                self._update_lag()
                if segments:
                    idle_since = None
                    continue
                if self.source.exhausted:
                    if self.cfg["release"]["on_exhausted"] and self.window["events"] > 0:
                        self.close_window()
                    break
                idle_since = idle_since or time.monotonic()
                if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                    break
            if self._dirty or self.pending:
                self.checkpoint()
            if self.pending:
                self._publish_pending()
                self.checkpoint()
        finally:
            self.close()

    def close(self) -> None:
        if self._producer is not None:
            self._producer.flush(timeout=10)
            self._producer.close(timeout=10)
            self._producer = None
        self.source.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- counting --------------------------------------------------------------------------------
    # ``ctx`` is whatever owns a state, a window and offsets: the service itself (one state per
    # process) or a partition task (scale-out, aggregator/service/partitioned.py).
    @staticmethod
    def _room(ctx) -> int | None:
        if ctx.window["kind"] != "count":
            return None
        return int(ctx.window["size"]) - int(ctx.window["events"])

    def _ingest(self, seg: Segment) -> None:
        if not len(seg):
            return
        items, good = self._decode(seg)
        self._count_segment(self, seg, items, good, self.close_window)

    def _decode(self, seg: Segment):
        """Decoded items of ``seg`` and the record index of each (None: all records good)."""
        decoded = self.decoder.decode(seg.values)
        if not decoded.rejected:
            return decoded.items, None
        for reason, count in decoded.reason_counts().items():
            self.metrics.decode_errors.labels(reason=reason).inc(count)
        self._dead_letter(seg, decoded.rejected)
        keep = np.ones(len(seg), dtype=bool)
        keep[[i for i, _ in decoded.rejected]] = False
        return decoded.items, np.flatnonzero(keep)

    def _count_segment(self, ctx, seg: Segment, items, good, close) -> None:
        """Count ``items`` into ``ctx``, closing its count window (``close()``) whenever it
        fills, so each window holds exactly its share and the offsets match the counters."""
        if len(items) == 0:
            ctx.offsets[seg.partition] = seg.offsets[-1] + 1
            ctx._dirty = True
            return
        start = 0
        while start < len(items):
            room = self._room(ctx)
            take = items[start:] if room is None else items[start:start + room]
            self._count(ctx.state, take)
            start += len(take)
            if start == len(items):
                ctx.offsets[seg.partition] = seg.offsets[-1] + 1
            else:
                last_rec = start - 1 if good is None else int(good[start - 1])
                ctx.offsets[seg.partition] = seg.offsets[last_rec] + 1
            ctx.window["events"] += len(take)
            ctx._since_ckpt_events += len(take)
            ctx._dirty = True
            self.metrics.events.inc(len(take))
            if ctx is self:
                self.metrics.window_events.set(self.window["events"])
                if room is not None:
                    self.metrics.window_progress.set(self.window["events"] / self.window["size"])
            if room is not None and self._room(ctx) == 0:
                close()

    def _count(self, state: PanPrivateHistogram, items: list) -> None:
        if self.direct:
            state.add_indices(np.asarray(items, dtype=np.int64))  # ranges checked by the decoder
        else:
            state.update(items)

    def _dead_letter(self, seg: Segment, rejected) -> None:
        topic = self.cfg["source"]["dead_letter_topic"]
        if not topic:
            return
        producer = self._kafka_producer()
        for i, reason in rejected:
            value = seg.values[i]
            producer.send(topic, value=bytes(value) if value is not None else b"",
                          headers=[("reason", reason.encode()),
                                   ("source", f"{seg.partition}@{seg.offsets[i]}".encode())])
            self.metrics.dead_letters.inc()

    def _kafka_producer(self):
        if self._producer is None:
            from kafka import KafkaProducer
            self._producer = KafkaProducer(bootstrap_servers=self.cfg["source"]["bootstrap"],
                                           acks="all", linger_ms=20)
        return self._producer

    def _checkpoint_due(self, ctx) -> bool:
        if not ctx._dirty:
            return False
        ck = self.cfg["checkpoint"]
        return (ctx._since_ckpt_events >= ck["every_events"]
                or time.monotonic() - ctx._last_ckpt >= ck["every_seconds"])

    def _maybe_close_time_window(self) -> None:
        if self.window["kind"] != "time":
            return
        elapsed = time.time() - self.window["started_unix"]
        self.metrics.window_progress.set(min(elapsed / self.window["size"], 1.0))
        if elapsed >= self.window["size"]:
            self.close_window()

    def _update_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag < 5.0:
            return
        self._last_lag = now
        lag = self.source.lag()
        for part, value in (lag or {}).items():
            if self._reports_lag_of(part):
                self.metrics.lag.labels(partition=part).set(value)

    def _reports_lag_of(self, partition: str) -> bool:
        return True

    # -- window close and release ----------------------------------------------------------------
    def close_window(self) -> dict | None:
        """Release the current window (if the budget allows) and start the next one, durably."""
        t0 = time.perf_counter()
        closing = dict(self.window, ended_unix=time.time())
        wid = closing["id"]
        entry_id = f"release-{wid}"
        release = None
        try:
            self.ledger.check_release(wid, self.epsilon, entry_id=entry_id)
            release = make_release(self.state, model=self.model, loss=self.loss, window=wid,
                                   rng=self._rng(1, wid))
            release["window_info"] = {k: closing[k] for k in
                                      ("kind", "size", "events", "started_unix", "ended_unix")}
            self.ledger.append(entry_id=entry_id, kind="release", window=wid,
                               epsilon_spent=self.epsilon, model=self.model)
            self.pending.append(json.dumps(release, allow_nan=False))
        except BudgetExceeded as exc:
            log.error("%s", exc)
            self.metrics.releases_refused.inc()
        self.state = self._new_state(wid + 1)
        self.window = self._new_window(wid + 1)
        self.metrics.window_id.set(wid + 1)
        self.metrics.window_events.set(0)
        self.metrics.window_progress.set(0)
        self.checkpoint()  # the close, the new window and the pending release, atomically
        self._publish_pending()
        self.metrics.release_duration.observe(time.perf_counter() - t0)
        self.metrics.budget_spent.set(self.ledger.spent())
        return release

    def _publish_pending(self) -> None:
        published = 0
        for doc in list(self.pending):
            release = json.loads(doc)
            try:
                path = write_release(release, self.cfg["release"]["dir"])
                topic = self.cfg["release"]["topic"]
                if topic:
                    producer = self._kafka_producer()
                    producer.send(topic, key=str(release["window"]).encode(), value=doc.encode())
                    producer.flush(timeout=30)
            except Exception as exc:  # retried on the next loop turn; the document is safe
                log.warning("publishing release of window %s failed (%s); will retry",
                            release["window"], type(exc).__name__)
                break
            self.pending.remove(doc)
            published += 1
            self.metrics.releases.inc()
            self.metrics.last_release.set(time.time())
            log.info("published release of window %s: n=%s -> %s", release["window"],
                     release["n"], path)
        if published:
            self._dirty = True

    # -- announced audit exports and control requests ---------------------------------------------
    def export(self, export_id: str | None = None) -> Path:
        """Signed snapshot for auditors, with fresh layers just before and just after it."""
        key = load_key(self.cfg["audit"]["key_file"] or None)
        self._export_seq += 1
        export_id = export_id or f"{int(time.time())}-{self.window['id']}-{self._export_seq}"
        return self._export_state(self, export_id, self.checkpoint,
                                  (self.window["id"], self._export_seq), key)

    def _export_state(self, ctx, export_id: str, checkpoint, tag: tuple, key: bytes) -> Path:
        """Export ``ctx``'s state (the service's, or a partition's): layer, snapshot, layer,
        checkpoint (both layers durable before the export exists), signed file, ledger."""
        ctx.state.rerandomize(rng=self._rng(2, *tag, 0))
        snapshot = ctx.state.serialize()
        ctx.state.rerandomize(rng=self._rng(2, *tag, 1))
        checkpoint()
        out_dir = Path(self.cfg["audit"]["dir"] or self.dir / "exports")
        path = write_export(out_dir / f"export-{export_id}.panagg", state=snapshot,
                            window=ctx.window, offsets=ctx.offsets, export_id=export_id, key=key)
        self._ledger_append(entry_id=f"export-{export_id}", kind="export",
                            window=ctx.window["id"], epsilon_spent=0.0, model=self.model,
                            note="announced export; fresh DLap layers before and after")
        self.metrics.exports.inc()
        log.info("audit export %s written to %s", export_id, path)
        return path

    def _ledger_append(self, **entry) -> None:
        self.ledger.append(**entry)

    def _handle_control(self) -> None:
        for req in sorted(self.control.glob("*.req")):
            kind, _, rid = req.stem.partition("-")
            done = req.with_suffix(".done")
            try:
                if kind == "export":
                    result = {"ok": True, "path": str(self.export(rid))}
                elif kind == "release":
                    rel = self.close_window()
                    result = {"ok": True, "window": None if rel is None else rel["window"]}
                else:
                    result = {"ok": False, "error": f"unknown request {kind}"}
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            done.write_text(json.dumps(result))
            req.unlink(missing_ok=True)


def service_running(checkpoint_dir: str | os.PathLike) -> bool:
    """True if a service holds the lock on ``checkpoint_dir``."""
    path = Path(checkpoint_dir) / "service.lock"
    if not path.exists():
        return False
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
    return False
