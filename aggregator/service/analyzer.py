"""The shuffle-model analyzer: ``panagg run`` with ``state.model = "shuffle"`` (docs/shuffle.md).

It reads the shuffler's analyzer topic (one partition, ``isolation_level=read_committed``; the
formats are in :mod:`.shuffle_wire`): per window, chunks of sealed boxes, then an end marker
``{"window": k, "end": true, "events": e, "topped_up": t, "messages": m[, "params": ...]}``.
It opens every box with its private key, adds the ``(bucket, sign)`` rows to two counters per
bucket (``plus``, ``minus``) and, at the end marker, releases the window through the same
estimators as the pan-private service:

* **gkmp**: ``counts = plus - minus = h + DLap(p)`` exactly
  (:func:`aggregator.shuffle.gkmp_analyze`) with ``p`` of
  ``GKMPRandomizer(epsilon, delta, n, B, gamma)``: one noise layer, none added here.
  The histogram sums to the window's real events ``e`` (top-ups carry noise only), so ``e`` is
  the public n the estimators get; ``n = e + t`` is what the noise law was calibrated for.
* **balcer-cheu**: the seed-002 analyzer on ``plus``
  (:func:`aggregator.shuffle.balcer_cheu_analyze`), then the anonymized histogram of its rounded
  estimates (no DLap estimator: the noise is not DLap).

Privacy. What the analyzer holds of a closed window, ``(plus, minus)``, is the multiset of the
shuffled messages: the (eps, delta)-DP view itself. The open window's partial sums come from a
prefix of the permuted list, a uniformly random sub-multiset of that view: post-processing of it.
So checkpoints may hold the partial sums (no replay under fresh noise is needed, unlike the
pan-private service), and the release adds nothing to the cost of the window.

Exactly once. A checkpoint holds the next offset of the analyzer partition, the open window's
sums up to there, and releases not yet published; it is written every
:data:`PARTIAL_CHECKPOINT_S` seconds inside a window and at every end marker. After a kill -9
the analyzer restores it and reads the topic again from its offset: sums are deterministic, so
nothing is lost or counted twice. A window is decided once: its release (or refusal) is ledgered
with the document before the checkpoint that closes it, and a replayed end marker finds it there.

A window is released only at its end marker, and only if the marker's message count equals the
messages received and counted, and ``events + topped_up`` equals the configured n (and the
marker's ``params``, when present, equal this analyzer's); otherwise it is refused with one
error line and a ``refused`` ledger entry. Undecryptable or malformed records go to the
dead-letter topic (``source.dead_letter_topic``) with a reason; logs name offsets, never content.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
from nacl.public import PrivateKey

from consumers.base import Segment, Source
from consumers.kafka_security import client_options, redacted
from state_store.atomic import atomic_write
from state_store.local import Checkpoint, LocalStore

from ..release import estimate_with_accuracy, package_release, stamp_window
from ..shuffle import BalcerCheuRandomizer, GKMPRandomizer, ShuffleConfigError
from .accuracy_plan import warn_if_below_noise
from .config import shuffle_n
from .deadletter import DeadLetters, service_producer
from .errors import ServiceError, Stopping
from .identity import choose_buckets_for, identity_of
from .ledger import BudgetExceeded, Ledger
from .metrics import Metrics
from .publisher import ReleasePublisher
from .settings import Config
from .shuffle_wire import (
    PARAM_KEYS,
    SEALED_SIZE,
    BoxOpener,
    ParamTag,
    WireError,
    end_record,
    load_private_key,
    parse_analyzer_record,
    public_key_hex,
)
from .stages.durable_write import wait_for_write
from .stages.release import release_method
from .stages.state_dir import claim_directory, remove_created

__all__ = ["ShuffleAnalyzer", "load_analyzer_key", "KEY_ENV", "PARTIAL_CHECKPOINT_S"]

log = logging.getLogger("panagg.analyzer")

KEY_ENV = "PANAGG_SHUFFLE_PRIVATE_KEY"
PARTIAL_CHECKPOINT_S = 5.0  # at most this long of the open window is re-read after a crash

#: dead-letter reasons of the analyzer
REASONS = (
    "malformed_record",
    "undecryptable",
    "other_parameters",
    "bucket_out_of_range",
    "bad_sign",
    "stale_window",
)


def load_analyzer_key(cfg: Config, env=None):
    """The analyzer's private key: ``shuffle.key_file``, else $PANAGG_SHUFFLE_PRIVATE_KEY (hex).
    Raises ServiceError with one line naming the fix."""

    env = os.environ if env is None else env
    path = cfg.shuffle.key_file
    if path:
        try:
            return load_private_key(path)
        except WireError as exc:
            raise ServiceError(f"shuffle.key_file: {exc}") from None
        except OSError as exc:
            raise ServiceError(
                f"shuffle.key_file {path}: {exc.strerror}; check the path and its permissions"
            ) from None
    text = env.get(KEY_ENV, "").strip()
    if not text:
        raise ServiceError(
            "state.model = shuffle needs the analyzer's private key: create one "
            "with `panagg shuffle-keygen --out FILE` and set shuffle.key_file = "
            f"FILE (or {KEY_ENV} to its 64 hex digits)"
        )
    try:
        return PrivateKey(bytes.fromhex(text))
    except (ValueError, TypeError):
        raise ServiceError(
            f"{KEY_ENV} must be 64 hex digits (a 32-byte X25519 private key, as "
            "`panagg shuffle-keygen` writes it)"
        ) from None


class ShuffleAnalyzer:
    """One analyzer process over the analyzer topic (see the module docstring).

    ``source`` is any :class:`consumers.base.Source` (the Kafka source in the service; tests
    may hand records in directly). ``private_key``: a ``nacl.public.PrivateKey``, else loaded by
    :func:`load_analyzer_key`.
    """

    def __init__(
        self,
        cfg: Config,
        source: Source,
        metrics: Metrics | None = None,
        *,
        private_key=None,
        fresh_start: bool = False,
        accept_change: bool = False,
    ):
        self.cfg, self.source = cfg, source
        self.metrics = metrics or Metrics()
        st, sh = cfg.state, cfg.shuffle
        self.epsilon, self.delta = float(st.epsilon), float(sh.delta)
        self.protocol, self.gamma, self.loss = sh.protocol, float(sh.gamma), st.loss
        self.direct = st.mode == "direct"
        self.buckets = int(st.domain_size) if self.direct else choose_buckets_for(cfg)
        self.n = shuffle_n(cfg)
        try:
            if self.protocol == "gkmp":
                self.randomizer = GKMPRandomizer(
                    self.epsilon, self.delta, self.n, self.buckets, gamma=self.gamma
                )
                self.p = self.randomizer.p
            else:
                self.randomizer = BalcerCheuRandomizer(
                    self.epsilon, self.delta, self.n, self.buckets
                )
                self.p = None
        except ShuffleConfigError as exc:
            raise ServiceError(f"shuffle protocol {self.protocol}: {exc}") from None
        #: the fingerprint every message of this analyzer's clients carries (shuffle_wire)
        self.tag = ParamTag.of(self.randomizer)
        #: the exact delta of a window's view at epsilon (the accountant's, sampling included);
        #: Balcer-Cheu beyond n = 5e6 has no exact value: its theorem's delta, an upper bound
        spent = getattr(self.randomizer, "delta_spent", None)
        self.delta_spent = float(spent) if spent is not None else self.delta
        self._recovering = False
        self.key = private_key if private_key is not None else load_analyzer_key(cfg)
        self.public_hex = public_key_hex(self.key)
        #: decryption over worker processes
        #: (shuffle_wire.BoxOpener; $PANAGG_SHUFFLE_DECRYPT_WORKERS)
        try:
            self.opener = BoxOpener(self.key)
        except WireError as exc:  # a malformed $PANAGG_SHUFFLE_DECRYPT_WORKERS
            raise ServiceError(str(exc)) from None
        self.dir = Path(cfg.checkpoint.dir)  # made by the start (_lock), not here
        self.fresh_start, self.accept_change = fresh_start, accept_change
        self.ledger = Ledger(
            self.dir / "ledger.jsonl",
            budget_per_window=cfg.budget_per_window,
            budget_total=cfg.ledger.budget_total or None,
        )
        self.store: LocalStore | None = None
        self._producer = None
        topic = cfg.source.dead_letter_topic
        self.dead_letters = (
            DeadLetters(topic, self._kafka_producer, self.metrics) if topic else None
        )
        self.stop_event = threading.Event()
        self._lock_file = None
        self.on_started = None  # called once the start succeeded (the CLI's metrics URL)
        self.publisher = ReleasePublisher(
            cfg.release.dir,
            cfg.release.topic,
            producer=self._kafka_producer,
            on_published=self._published,
            plot=cfg.release.plots,
        )
        # the live position
        self.window: dict | None = None  # the open window (None between windows)
        self.plus = np.zeros(self.buckets, dtype=np.int64)
        self.minus = np.zeros(self.buckets, dtype=np.int64)
        self.offsets: dict[str, int] = {}
        self.pending: list[str] = []
        self.totals: dict = {"events": 0, "windows": 0, "refused": 0, "rejects": {}}
        self.last_closed: int | None = None
        self._dirty = False  # offsets moved since the last checkpoint
        self._checkpoint_at = time.monotonic()
        self._said: set = set()  # (kind, window) error lines already logged
        #: the counts of the last window released (tests and the release audit; never written)
        self.last_counts: np.ndarray | None = None
        self.metrics.epsilon.set(self.epsilon)

    # -- lifecycle -----------------------------------------------------------------------------
    def _lock(self) -> None:
        # what this start creates, removed again if the start is refused (it writes nothing)
        self._created, self._lock_file = claim_directory(self.dir)

    def identity(self) -> dict:
        mine = identity_of(self.cfg)
        mine["item"] = "shuffle-model client messages"
        mine["shuffle"] = (
            f"{self.protocol} n={self.n} delta={self.delta:g}"
            + (f" gamma={self.gamma:g}" if self.protocol == "gkmp" else "")
            + f" key={self.public_hex}"
        )
        return mine

    def check_identity(self) -> None:
        mine, recorded = self.identity(), self.ledger.identity()
        if recorded is None:
            self.ledger.append(
                entry_id=f"identity-{os.urandom(6).hex()}",
                kind="identity",
                identity=dict(mine, run=os.urandom(8).hex()),
            )
            return
        changed = [k for k in mine if recorded.get(k) != mine[k]]
        if not changed:
            return
        what = ", ".join(f"{k} {recorded.get(k)!r} -> {mine[k]!r}" for k in changed)
        if not self.accept_change:
            raise ServiceError(
                f"checkpoint.dir {self.dir} belongs to other settings ({what}); "
                "use the original settings, a new checkpoint.dir, or "
                "--accept-change to record the change in the ledger"
            )
        self.ledger.append(
            entry_id=f"identity-{os.urandom(6).hex()}",
            kind="identity",
            identity=dict(recorded, **mine),
            previous=recorded,
            note=f"settings changed: {what}",
        )
        log.warning("settings of %s changed and recorded in the ledger: %s", self.dir, what)

    def restore(self) -> None:
        self.check_identity()
        self.store = LocalStore(self.dir / "checkpoints")
        ckpt = self.store.load_latest()
        if ckpt is None:
            released = [e for e in self.ledger.entries if e["kind"] in ("release", "refused")]
            if released and not self.fresh_start:
                raise ServiceError(
                    f"no checkpoint in {self.store.dir}, but the ledger in {self.dir} records "
                    f"{len(released)} decided window(s): the checkpoint was lost or moved away. "
                    "Restore it from a backup, or start with --fresh-start (the topic is then "
                    "read from its start and windows already decided are refused again)"
                )
            log.info(
                "no checkpoint in %s: reading the analyzer topic from its start", self.store.dir
            )
            self._commit()
        else:
            meta = dict(ckpt.window)
            if int(meta.get("buckets", -1)) != self.buckets:
                raise ServiceError(
                    f"the checkpoint in {self.store.dir} counts "
                    f"{meta.get('buckets')} buckets, the config {self.buckets}; "
                    "use the original settings or a new checkpoint.dir"
                )
            self.window = meta.get("open")
            self.last_closed = meta.get("last_closed")
            self.offsets = {k: int(v) for k, v in ckpt.offsets.items()}
            self.pending = list(ckpt.pending)
            self.totals = dict(self.totals, **ckpt.totals)
            if ckpt.state:
                sums = np.frombuffer(ckpt.state, dtype="<i8").reshape(2, self.buckets)
                self.plus, self.minus = sums[0].copy(), sums[1].copy()
            log.info(
                "restored checkpoint %d: %s; reading on from offset(s) %s",
                ckpt.seq,
                f"window {self.window['id']} open with {self.window['received']:,} messages"
                if self.window
                else "no window open",
                ", ".join(f"{k}: {v}" for k, v in sorted(self.offsets.items())) or "start",
            )
        self.source.seek(self.offsets)
        self.metrics.events.inc(int(self.totals.get("events", 0)))
        for reason, count in self.totals["rejects"].items():
            self.metrics.decode_errors.labels(reason=reason).inc(count)
        if self.window:
            self.metrics.window_id.set(self.window["id"])
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        """Consume until stopped, or (``idle_exit_s``) until the topic is idle that long."""
        self._lock()
        started = False
        try:
            self.restore()
            # after the checks: a refused start writes none
            atomic_write(
                self.dir / "config.json",
                json.dumps(redacted(self.cfg), indent=1, sort_keys=True),
                mode=None,
            )
            started = True
            log.info(
                "shuffle analyzer: %s, %d buckets, n=%d, epsilon %g, delta %g%s; public key %s",
                self.protocol,
                self.buckets,
                self.n,
                self.epsilon,
                self.delta,
                f", DLap p={self.p:.6g}" if self.p is not None else "",
                self.public_hex,
            )
            if self.on_started is not None:
                self.on_started()
            self._publish_pending()
            idle_since = None
            while not self.stop_event.is_set():
                segments = self.source.poll(poll_timeout_s)
                for seg in segments:
                    self.ingest(seg)
                if self._dirty and time.monotonic() - self._checkpoint_at >= PARTIAL_CHECKPOINT_S:
                    self._commit()
                if self.pending:
                    self._publish_pending()
                self.metrics.heartbeat()
                self.metrics.set_ready(True)
                if segments:
                    idle_since = None
                    continue
                if getattr(self.source, "exhausted", False):
                    break
                if idle_exit_s is None or not self._caught_up():
                    continue
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since >= idle_exit_s:
                    break
            if self._dirty:
                self._commit()
            if self.pending:
                self.publisher.retry_now(wait_s=10.0)
                self._publish_pending()
        except Stopping:
            log.info(
                "stopped while waiting for a write; the analyzer resumes from its last "
                "checkpoint at the next start"
            )
        finally:
            self.close()
            if not started:
                remove_created(self._created)
            log.info(
                "stopped: %s",
                f"window {self.window['id']} open with "
                f"{self.window['received']:,} messages (kept in the checkpoint)"
                if self.window
                else "no window open",
            )

    def _caught_up(self) -> bool:
        assigned = getattr(self.source, "assigned", None)
        if assigned is None:
            return True
        probe = getattr(self.source, "caught_up", None)
        return bool(assigned) and (probe is None or bool(probe(sorted(assigned))))

    def close(self) -> None:
        self.publisher.close()
        self.opener.close()
        if self.dead_letters is not None:
            self.dead_letters.close()
        if self._producer is not None:
            try:
                self._producer.flush(timeout=5)
                self._producer.close(timeout=5)
            except Exception:
                pass
            self._producer = None
        if self.source is not None:
            self.source.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- records -------------------------------------------------------------------------------
    def ingest(self, seg: Segment) -> None:
        """Every record of ``seg`` once, in offset order; the offset moves past each."""
        for i, value in enumerate(seg.values):
            offset = int(seg.offsets[i])
            self._record(seg.partition, offset, value)
            self.offsets[seg.partition] = offset + 1
            self._dirty = True

    def _record(self, partition: str, offset: int, value) -> None:
        try:
            doc = parse_analyzer_record(bytes(value) if value is not None else b"")
            if doc.get("end") is True:
                for field in ("events", "topped_up", "messages"):
                    if (
                        not isinstance(doc.get(field), int)
                        or isinstance(doc.get(field), bool)
                        or doc[field] < 0
                    ):
                        raise WireError(f"end marker has no non-negative integer {field!r}")
                if doc.get("params") is not None and not isinstance(doc["params"], dict):
                    raise WireError("end marker's params is not a map")
        except WireError as exc:
            self._reject(partition, offset, value, "malformed_record", str(exc))
            return
        k = int(doc["window"])
        open_id = self.window["id"] if self.window is not None else None
        if (open_id is not None and k < open_id) or (
            open_id != k and self.last_closed is not None and k <= self.last_closed
        ):
            self._reject(partition, offset, value, "stale_window", None)
            if ("stale", k) not in self._said:
                self._said.add(("stale", k))
                log.error(
                    "window %d appears again on the analyzer topic at %s offset %d, after "
                    "it or a later window was decided or opened: ignored (dead letters, "
                    "reason stale_window); the shuffler wrote a window twice or out of "
                    "order",
                    k,
                    partition,
                    offset,
                )
            return
        if self.window is not None and self.window["id"] != k:
            self._refuse(
                f"window {self.window['id']} ended without its end marker (window {k} "
                f"began at {partition} offset {offset}): not released (its messages "
                "are incomplete)"
            )
        if self.window is None:
            self.window = {
                "id": k,
                "uid": f"{partition}@{offset}",
                "received": 0,
                "lost": 0,
                "records": 0,
                "started_unix": time.time(),
            }
            self.metrics.window_id.set(k)
        self.window["records"] += 1
        if doc.get("end") is True:
            self._close(doc, partition, offset)
            return
        self._chunk(doc["boxes"], partition, offset, value)

    def _lose(
        self, boxes, partition: str, offset: int, value, reason: str, detail: str | None = None
    ) -> None:
        """A chunk of the open window not counted: tallied by reason (the refusal names the
        cause from these tallies) and dead-lettered."""
        w = self.window
        w["lost"] += len(boxes)
        causes = w.setdefault("causes", {})
        causes[reason] = causes.get(reason, 0) + 1
        self._reject(partition, offset, value, reason, detail)

    def _chunk(self, boxes, partition: str, offset: int, value) -> None:
        """Open one chunk's boxes and add its rows to the window's sums, or set it aside
        (dead letters) with the reason: another key, other parameters, bad rows."""
        w = self.window
        w["chunks"] = w.get("chunks", 0) + 1
        if not all(isinstance(b, bytes) and len(b) == SEALED_SIZE for b in boxes):
            self._lose(
                boxes,
                partition,
                offset,
                value,
                "malformed_record",
                f"boxes must be {SEALED_SIZE} bytes each (wire v2)",
            )
            return
        try:
            opened = self.opener.open(boxes)
        except WireError:
            self._lose(boxes, partition, offset, value, "undecryptable")
            return
        fps = opened.fingerprints
        foreign = fps != np.uint64(self.tag.fingerprint_u64)
        if foreign.any():
            # messages randomized under other parameters: the window cannot be released under
            # this analyzer's privacy claim. Keep what names those parameters (fingerprint,
            # descriptor parts seen) for the refusal line.
            seen = w.setdefault("foreign", {})
            for fp in np.unique(fps[foreign]).tolist():
                mine = fps == np.uint64(fp)
                entry = seen.setdefault(f"{fp:016x}", {"messages": 0, "parts": {}})
                entry["messages"] += int(mine.sum())
                for i, c in zip(opened.part[mine].tolist(), opened.chunk[mine].tolist()):
                    entry["parts"].setdefault(str(i), f"{c:016x}")
            w["native"] = w.get("native", 0) + int((~foreign).sum())
            self._lose(boxes, partition, offset, value, "other_parameters")
            return
        rows = opened.rows
        if len(rows) and (rows[:, 0].min() < 0 or rows[:, 0].max() >= self.buckets):
            self._lose(boxes, partition, offset, value, "bucket_out_of_range")
            return
        signs = rows[:, 1]
        if not np.all((signs == 1) | ((signs == -1) & (self.protocol == "gkmp"))):
            self._lose(boxes, partition, offset, value, "bad_sign")
            return
        self.plus += np.bincount(rows[signs > 0, 0], minlength=self.buckets)
        self.minus += np.bincount(rows[signs < 0, 0], minlength=self.buckets)
        w["received"] += len(rows)

    def _reject(self, partition: str, offset: int, value, reason: str, detail: str | None) -> None:
        """A record that is not counted: dead letter (reason, position; never logged content)."""
        rejects = self.totals["rejects"]
        rejects[reason] = rejects.get(reason, 0) + 1
        self.metrics.decode_errors.labels(reason=reason).inc()
        if self.dead_letters is not None:
            self.dead_letters.send(
                partition, offset, value if isinstance(value, bytes) else b"", reason
            )
        if reason in ("undecryptable", "other_parameters", "bucket_out_of_range", "bad_sign"):
            # the window's refusal names the cause in one line; per chunk, debug only
            log.debug(
                "window %s: chunk at %s offset %d not counted (%s)",
                self.window["id"] if self.window else None,
                partition,
                offset,
                reason,
            )
        elif reason == "malformed_record":
            log.warning(
                "rejected record at %s offset %d: %s (%s)", partition, offset, reason, detail
            )

    # -- window end ----------------------------------------------------------------------------
    def _foreign_line(self, k: int, foreign: dict, total: int) -> tuple[str, str]:
        """(cause, line) for a window holding messages of other parameters."""
        parts, causes = [], set()
        for fp_hex, seen in sorted(foreign.items(), key=lambda kv: -kv[1]["messages"])[:2]:
            tag = ParamTag.from_parts(
                int(fp_hex, 16),
                {int(i): int(c, 16).to_bytes(8, "little") for i, c in seen["parts"].items()},
            )
            share = f"{seen['messages']:,} of {total:,} messages"
            if tag is None:
                causes.add("parameters")
                parts.append(
                    f"{share} carry parameter fingerprint {fp_hex} (not this analyzer's; "
                    "the clients' parameters could not be rebuilt from them)"
                )
                continue
            diff = tag.differences(self.tag)
            causes.add("buckets" if [d[0] for d in diff] == ["buckets"] else "parameters")
            parts.append(
                f"{share} were randomized with "
                + ", ".join(f"{key} {theirs} (analyzer: {mine})" for key, theirs, mine in diff)
                + f" [clients: {tag.describe()}]"
            )
        more = f"; and {len(foreign) - 2} other fingerprint(s)" if len(foreign) > 2 else ""
        cause = "buckets" if causes == {"buckets"} else "parameters"
        return cause, (
            f"window {k}: not released: its clients used other parameters than this "
            f"analyzer ({self.tag.describe()}): {'; '.join(parts)}{more}. A release "
            "would claim a privacy the clients did not give. Give clients, shuffler "
            "and analyzer the same settings (state.epsilon, the number of buckets, "
            "[shuffle]); this window can still be released under the clients' "
            f"parameters: `panagg shuffle-recover --window {k}` (docs/shuffle.md, "
            '"Recovering a refused window")'
        )

    def _problem(self, doc: dict) -> tuple[str, str] | None:
        """``(cause, one line)``: why the window that ``doc`` ends cannot be released (None: it
        can). Causes, first match: ``parameters`` / ``buckets`` (messages carry another
        fingerprint), ``key`` (chunks that do not decrypt), ``corrupt`` (rows outside the
        buckets or bad signs under this analyzer's own fingerprint), ``malformed``, ``count``
        (messages missing or extra), ``n`` (the marker's events + top-ups)."""
        w, k = self.window, self.window["id"]
        causes = w.get("causes") or {}
        chunks = w.get("chunks", 0)
        recover = (
            f" Once fixed, `panagg shuffle-recover --window {k}` releases it "
            '(docs/shuffle.md, "Recovering a refused window")'
        )
        if w.get("foreign"):
            return self._foreign_line(k, w["foreign"], int(doc["messages"]))
        if causes.get("undecryptable"):
            bad = causes["undecryptable"]
            if bad == chunks and not w["received"]:
                why = (
                    f"no message decrypts with this analyzer's key (public key "
                    f"{self.public_hex}): the clients seal to another public key"
                )
            else:
                why = (
                    f"{bad:,} of {chunks:,} chunks do not decrypt with this analyzer's key "
                    f"(public key {self.public_hex}): sealed to another key, or corrupted"
                )
            return "key", (
                f"window {k}: not released: {why} ({w['lost']:,} messages in dead "
                "letters, reason undecryptable). Give the clients this key's public "
                "key (`panagg shuffle-keygen` printed it) or set shuffle.key_file to "
                "the key they seal to." + recover
            )
        corrupt = causes.get("bucket_out_of_range", 0) + causes.get("bad_sign", 0)
        if corrupt:
            return "corrupt", (
                f"window {k}: not released: {corrupt:,} chunk(s) hold buckets "
                f"outside [0, {self.buckets:,}) or bad signs although their "
                "messages carry this analyzer's parameter fingerprint: "
                "non-conforming or corrupted clients (dead letters, reasons "
                "bucket_out_of_range / bad_sign)"
            )
        if causes.get("malformed_record"):
            return "malformed", (
                f"window {k}: not released: {causes['malformed_record']:,} "
                f"chunk(s) are malformed (boxes not {SEALED_SIZE} bytes: a "
                "shuffler or clients of another wire version?), dead-lettered"
            )
        if w["received"] != doc["messages"]:
            return "count", (
                f"window {k}: not released: the end marker counts "
                f"{doc['messages']:,} messages, {w['received']:,} were received and "
                "counted (a partial window's noise is not the calibrated law)"
            )
        outputs = doc["events"] + doc["topped_up"]
        if outputs != self.n:
            return "n", (
                f"window {k}: not released: it holds {doc['events']:,} events + "
                f"{doc['topped_up']:,} top-ups = {outputs:,} randomizer outputs, but this "
                f"analyzer is calibrated for shuffle.n = {self.n:,}; give clients, "
                "shuffler and analyzer the same n (shuffle.n, or window.size for count "
                "windows)"
            )
        params = doc.get("params") or {}
        mine = dict(self.tag.params)
        differ = [
            f"{key} {params[key]!r} (analyzer: {mine[key]!r})"
            for key in PARAM_KEYS
            if key in params
            and mine.get(key) is not None
            and params[key] != mine[key]
            and not (
                isinstance(mine[key], float)
                and isinstance(params[key], (int, float))
                and abs(float(params[key]) - mine[key]) <= 1e-12 * abs(mine[key])
            )
        ]
        if differ and ("params", k) not in self._said:
            # every message carries this analyzer's fingerprint, so the view is the calibrated
            # one; only the shuffler's configuration (its top-ups, none here) differs
            self._said.add(("params", k))
            log.warning(
                "window %d: the shuffler's end marker names other parameters (%s) but "
                "every message carries this analyzer's: released; fix the shuffler's "
                "settings before it tops up a short window",
                k,
                ", ".join(differ),
            )
        return None

    def _problem_or_budget(self, doc: dict, uid: str, k: int) -> tuple[str, str] | None:
        """Why window ``k`` (uid ``uid``: its first record's position) may not be released: its
        end marker (:meth:`_problem`), else the ledger's budget; None when it may."""
        problem = self._problem(doc)
        if problem is None:
            try:
                self.ledger.check_release(uid, self.epsilon, window=k)
            except BudgetExceeded as exc:
                problem = ("budget", str(exc))
        return problem

    def _close(self, doc: dict, partition: str, offset: int) -> None:
        w = self.window
        k, uid = w["id"], w["uid"]
        release = None
        entry = self.ledger.get(f"release-{uid}")
        if entry is not None:
            log.info("window %d is already in the ledger: re-publishing its ledgered release", k)
            release = json.loads(entry["document"])
        elif self.ledger.has(f"refused-{uid}"):
            log.info("window %d was refused before (ledger): not released", k)
        else:
            problem = self._problem_or_budget(doc, uid, k)
            if problem is not None:
                self._refuse(
                    problem[1],
                    end=f"{partition}:{offset + 1}",
                    cause=problem[0],
                    marker={f: doc[f] for f in ("events", "topped_up", "messages")},
                )
                self._commit()
                return
            release = self._release(doc, partition, offset)
        if release is not None:
            self.pending.append(json.dumps(release, allow_nan=False))
        self._next_window(k)
        self._commit()
        self._publish_pending()

    def _refuse(
        self, problem: str, end: str = "", cause: str = "incomplete", marker: dict | None = None
    ) -> None:
        """Decide the open window as refused: one error line, a ledger entry, sums dropped.
        ``marker``: the end marker's counts, kept so the window can be recovered from the
        dead-letter topic alone (its chunks are there; the marker is not)."""
        w = self.window
        log.error("%s", problem)
        self.metrics.releases_refused.inc()
        self.totals["refused"] = self.totals.get("refused", 0) + 1
        self.ledger.append(
            entry_id=f"refused-{w['uid']}",
            kind="refused",
            window=w["id"],
            window_uid=w["uid"],
            model="shuffle",
            note=problem,
            end=end,
            cause=cause,
            **({"marker": marker} if marker else {}),
        )
        self._next_window(w["id"])

    def _next_window(self, k: int) -> None:
        self.window = None
        self.plus[:] = 0
        self.minus[:] = 0
        self.last_closed = k if self.last_closed is None else max(self.last_closed, k)
        self.totals["windows"] = self.totals.get("windows", 0) + 1

    def _release(self, doc: dict, partition: str, offset: int) -> dict:
        """The window's release document, computed once and ledgered with it."""
        w, k = self.window, self.window["id"]
        started = time.perf_counter()
        events = int(doc["events"])
        hashed = None if self.direct else self.buckets
        if self.protocol == "gkmp":
            counts = self.plus - self.minus  # = gkmp_analyze(messages): h + DLap(p)
            self.last_counts = counts.copy()
            hist, accuracy = estimate_with_accuracy(
                counts,
                self.p,
                layers=1,
                loss=self.loss,
                n=events,
                buckets=hashed,
                reps=int(self.cfg.release.error_bar_reps),
                method=release_method(self.cfg),
            )
            extra = {"p": self.p, "layers": 1}
        else:
            rz = self.randomizer  # = balcer_cheu_analyze(messages, B, rz)
            est = np.where(self.plus > rz.n, self.plus - rz.s * rz.n, 0.0)
            self.last_counts = est.copy()
            rounded = np.rint(est).astype(np.int64)
            hist = np.sort(rounded[rounded > 0])[::-1]
            accuracy = {
                "estimator": "balcer-cheu (seed 002 analyzer: N_j - s n where N_j > n, rounded)",
                "intervals": None,
                "intervals_note": "no DLap noise model: the Balcer-Cheu analyzer's "
                "estimates are released as they are",
            }
            extra = {"p": None, "layers": None}
        extra.update(
            {
                "loss": self.loss if self.protocol == "gkmp" else None,
                "domain": {"mode": "direct" if self.direct else "hashed", "size": self.buckets},
                "protocol": self.protocol,
                "delta": self.delta,
                "delta_spent": self.delta_spent,
                "shuffle": {
                    "n": self.n,
                    "gamma": self.gamma if self.protocol == "gkmp" else None,
                    "s": getattr(self.randomizer, "s", None),
                    "analyzer_public_key": self.public_hex,
                },
            }
        )
        release = package_release(
            hist,
            window=k,
            n=events,
            epsilon=self.epsilon,
            neighbor="replace-one",
            model="shuffle",
            extra=extra,
            accuracy=accuracy if self.protocol == "gkmp" else None,
        )
        if self.protocol != "gkmp":
            release["accuracy"] = accuracy
        release["release_seconds"] = time.perf_counter() - started
        release["window_info"] = {
            "kind": self.cfg.window.kind,
            "size": self.cfg.window.size,
            "events": events,
            "topped_up": int(doc["topped_up"]),
            "messages": int(doc["messages"]),
            "started_unix": w["started_unix"],
            "ended_unix": time.time(),
        }
        stamp_window(release)
        release["counted"] = {
            "stream": f"kafka:{self.cfg.source.topic}",
            "item": f"shuffle:{self.protocol} messages",
        }
        if (release.get("accuracy") or {}).get("signal_below_noise"):
            warn_if_below_noise(release)
        extra = {"recovered_from": f"refused-{w['uid']}"} if self._recovering else {}
        self.ledger.append(
            entry_id=f"release-{w['uid']}",
            kind="release",
            window=k,
            window_uid=w["uid"],
            epsilon_spent=self.epsilon,
            delta_spent=self.delta_spent,
            delta=self.delta,
            model="shuffle",
            protocol=self.protocol,
            params=self.tag.params,
            document=json.dumps(release, allow_nan=False),
            end_offsets={partition: offset + 1},
            **extra,
        )
        self.totals["events"] = self.totals.get("events", 0) + events
        self.metrics.events.inc(events)
        return release

    # -- recovery of refused windows ----------------------------------------------------------
    def recover(self, windows=None, records=None) -> list[tuple[int, str, str]]:
        """Release windows the ledger records as refused, now that the cause is fixed (docs/
        shuffle.md, "Recovering a refused window"): ``[(window, uid, outcome)]``.

        This analyzer is configured with what the fix needs: the key the clients sealed to, or
        the clients' parameters (epsilon, delta, buckets, ...: the privacy they actually gave).
        For each refused window (``windows``: their numbers; None: every refused window) it
        reads the window's records again, from its first record (the position its uid names) to
        its end marker, from the analyzer topic (``records(partition, start, end)`` -> ``[(offset,
        value)]`` instead, for tests), and decides it exactly as at its marker: released (ledger
        entry ``release-<uid>`` charging this analyzer's epsilon and exact delta, beside the
        ``refused-<uid>`` entry that charged nothing), or still refused (one error line, nothing
        ledgered). A window already recovered is re-published from its ledgered document, never
        computed again, so running this twice publishes once. It holds the state directory's
        lock (stop the analyzer first) and never touches its checkpoint or offsets.
        """
        self._lock()
        self._recovering = True
        self.dead_letters = None  # its records were dead-lettered when it was refused
        out = []
        try:
            want = None if windows is None else {int(x) for x in windows}
            refused = [
                e
                for e in self.ledger.entries
                if e["kind"] == "refused" and (want is None or e["window"] in want)
            ]
            for k in sorted((want or set()) - {e["window"] for e in refused}):
                log.error(
                    "window %d: the ledger in %s records no refused window with this "
                    "number: nothing to recover",
                    k,
                    self.dir,
                )
                out.append((k, "", "not refused"))
            for entry in refused:
                outcome = self._recover_one(entry, records)
                out.append((entry["window"], entry["window_uid"], outcome))
            if self.pending:
                self.publisher.retry_now(wait_s=10.0)
                self._publish_pending()
                for doc in self.pending:
                    out = [
                        (k, u, "ledgered, not yet published (run again)")
                        if k == json.loads(doc)["window"]
                        else (k, u, o)
                        for k, u, o in out
                    ]
        finally:
            self._recovering = False
            self.close()
        return out

    def _read_range(self, partition: str, start: int, end: int) -> list[tuple[int, bytes]]:
        """Records ``[start, end)`` of ``partition`` ("topic:p") of the analyzer topic, read
        committed, with no consumer group (nothing committed, no rebalance of the analyzer's)."""
        # a Kafka client is loaded by a Kafka run only
        from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

        topic, _, p = partition.rpartition(":")
        consumer = KafkaConsumer(
            bootstrap_servers=self.cfg.source.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
            allow_auto_create_topics=False,
            max_partition_fetch_bytes=int(self.cfg.source.max_partition_fetch_bytes),
            **client_options(self.cfg.security),
        )
        try:
            tp = TopicPartition(topic, int(p))
            consumer.assign([tp])
            first = consumer.beginning_offsets([tp])[tp]
            if first > start:
                return []
            consumer.seek(tp, start)
            out, idle = [], 0
            while idle < 20:
                got = consumer.poll(timeout_ms=500)
                recs = got.get(tp, [])
                idle = 0 if recs else idle + 1
                for r in recs:
                    if r.offset >= end:
                        return out
                    out.append((r.offset, r.value))
                if consumer.position(tp) >= end:
                    return out
            return out
        finally:
            consumer.close()

    def _read_dead_letters(self, partition: str, start: int, end: int) -> list[tuple[int, bytes]]:
        """The dead letters of positions ``partition@[start, end)`` (their key), by offset;
        the whole dead-letter topic is read once (no group, nothing committed)."""
        # a Kafka client is loaded by a Kafka run only
        from kafka import KafkaConsumer, TopicPartition  # noqa: PLC0415

        topic = self.cfg.source.dead_letter_topic
        consumer = KafkaConsumer(
            bootstrap_servers=self.cfg.source.bootstrap,
            group_id=None,
            enable_auto_commit=False,
            isolation_level="read_committed",
            allow_auto_create_topics=False,
            **client_options(self.cfg.security),
        )
        found: dict[int, bytes] = {}
        try:
            parts = consumer.partitions_for_topic(topic) or set()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            if not tps:
                return []
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            ends = consumer.end_offsets(tps)
            idle = 0
            while idle < 20 and any(consumer.position(tp) < ends[tp] for tp in tps):
                got = consumer.poll(timeout_ms=500)
                idle = 0 if got else idle + 1
                for recs in got.values():
                    for r in recs:
                        where, _, off = (r.key or b"").decode(errors="replace").rpartition("@")
                        if (
                            where == partition
                            and off.isdigit()
                            and start <= int(off) < end
                            and not dict(r.headers or []).get("truncated")
                        ):
                            found[int(off)] = r.value
        finally:
            consumer.close()
        return sorted(found.items())

    def _recover_one(self, entry: dict, records) -> str:
        uid, k = entry["window_uid"], entry["window"]
        done = self.ledger.get(f"release-{uid}")
        if done is not None:
            log.info("window %d was recovered before: re-publishing its ledgered release", k)
            self.pending.append(done["document"])
            return "re-published"
        if not entry.get("end"):
            log.error(
                "window %d cannot be recovered: it ended without its end marker (its "
                "messages are incomplete)",
                k,
            )
            return "not recoverable"
        partition, _, start = uid.rpartition("@")
        end = int(entry["end"].rpartition(":")[2])
        recs = (records or self._read_range)(partition, int(start), end)
        source = "the analyzer topic"
        if (
            not recs
            and entry.get("marker")
            and (records is not None or self.cfg.source.dead_letter_topic)
        ):
            # retention took the window off the analyzer topic: its chunks were dead-lettered
            # when it was refused (keyed by their positions), the ledger kept the marker's counts
            dead = (
                records(partition, int(start), end, dead_letters=True)
                if records
                else self._read_dead_letters(partition, int(start), end)
            )
            if dead:
                recs = dead + [(end - 1, end_record(k, **entry["marker"]))]
                source = "the dead-letter topic"
        self.window, self.last_closed = None, None
        self.plus[:] = 0
        self.minus[:] = 0
        marker = None
        for offset, value in recs:
            try:
                doc = parse_analyzer_record(bytes(value) if value is not None else b"")
            except WireError:
                doc = None
            if self.window is None:
                if offset != int(start) or doc is None or int(doc["window"]) != k:
                    break
                self.window = {
                    "id": k,
                    "uid": uid,
                    "received": 0,
                    "lost": 0,
                    "records": 0,
                    "started_unix": time.time(),
                }
            if doc is None or int(doc["window"]) != k:
                continue  # not one of this window's records (a malformed or stale one)
            self.window["records"] += 1
            if doc.get("end") is True:
                marker = (doc, offset)
                break
            self._chunk(doc["boxes"], partition, offset, value)
        if self.window is None or marker is None or marker[1] != end - 1:
            log.error(
                "window %d cannot be recovered: neither the analyzer topic nor the "
                "dead-letter topic (%s) holds its records %s..%d whole",
                k,
                self.cfg.source.dead_letter_topic or "none set",
                f"{partition}@{start}",
                end - 1,
            )
            self.window = None
            return "records gone"
        doc, offset = marker
        problem = self._problem_or_budget(doc, uid, k)
        if problem is not None:
            log.error("still refused: %s", problem[1])
            self.window = None
            return f"still refused ({problem[0]})"
        release = self._release(doc, partition, offset)
        log.info(
            "window %d recovered from %s (refused before: %s): released at epsilon %g, delta %.3g",
            k,
            source,
            entry.get("cause", "?"),
            self.epsilon,
            self.delta_spent,
        )
        self.pending.append(json.dumps(release, allow_nan=False))
        self.window = None
        return "released"

    # -- checkpoint and publishing -------------------------------------------------------------
    def _commit(self) -> None:
        """Dead letters acknowledged, then the checkpoint (atomic), then offsets for lag."""
        if self.dead_letters is not None:
            self._wait_for(lambda: self.dead_letters.flush(timeout_s=10.0), "dead letters")
        state = (
            np.stack([self.plus, self.minus]).astype("<i8").tobytes()
            if self.window is not None
            else None
        )
        record = Checkpoint(
            state=state,
            window={
                "open": self.window,
                "buckets": self.buckets,
                "last_closed": self.last_closed,
                "id": self.window["id"] if self.window else (self.last_closed or 0) + 1,
            },
            offsets=dict(self.offsets),
            pending=list(self.pending),
            totals=json.loads(json.dumps(self.totals)),
        )
        t0 = time.perf_counter()
        self._wait_for(lambda: self.store.save(record), "checkpoint")
        self.metrics.checkpointed(time.perf_counter() - t0)
        self._dirty, self._checkpoint_at = False, time.monotonic()
        self.source.commit(record.offsets)

    def _wait_for(self, action, what: str) -> None:
        wait_for_write(action, what, self.metrics, stop=self.stop_event.wait, directory=self.dir)

    def _publish_pending(self) -> None:
        """Deliver the ledgered releases (:mod:`.publisher`): files at once, the release topic
        retried on its own."""
        if not self.pending or not self.publisher.due():
            return
        done = self.publisher.publish(list(self.pending))
        for doc in done:
            self.pending.remove(doc)
        if done and self.store is not None:  # (recovery keeps no checkpoint)
            self._commit()

    def _published(self, release: dict, path) -> None:
        self.metrics.releases.inc()
        self.metrics.last_release.set(time.time())
        self.metrics.published(release)
        log.info(
            "published release of window %s (shuffle, %s): n=%s -> %s",
            release["window"],
            release.get("protocol"),
            release["n"],
            path,
        )

    def _kafka_producer(self):
        if self._producer is None:
            self._producer = service_producer(self.cfg)
        return self._producer
