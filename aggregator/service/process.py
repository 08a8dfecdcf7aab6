"""The streaming service: source -> decode -> count -> window close -> release, with checkpoints.

Exactly once, by replay. The open window's counters live only in memory (docs/privacy.md: a
checkpoint holding the same noise as memory would let one intrusion read the exact recent
events). A checkpoint holds where the window starts in the source, the totals up to there and the
releases not yet published (plus, optionally, a layered snapshot: :mod:`.window`). After a crash,
a stop or a handover the service seeks the source back to the checkpoint's offsets and counts the
window again under fresh noise. A crash at any instant therefore neither loses nor double-counts
an event; it costs a replay of at most one window (or one snapshot interval), and the source must
retain that much (checked at start for Kafka time windows; a window the source no longer holds
stops the service with one line).

Windows. Tumbling, by event count or processing time; each window starts a fresh state with fresh
noise and a random uid. Closing a window: the ledger is consulted (budget) before any release
noise is drawn; the release is computed once and ledgered *with its document* before the
checkpoint that starts the next window; publishing happens from that document. A window the
ledger already holds (a crash after the ledger entry, or a restored older checkpoint) is
re-published from the ledgered document, never computed again.

The checkpoint commit is one numbered sequence (:meth:`Aggregator.commit`):

1. dead letters of every record before the new offsets are acknowledged by the broker;
2. (snapshot only) a fresh noise layer on the live counters, the snapshot, another fresh layer;
3. the checkpoint is written atomically (temp file, fsync, rename, directory fsync);
4. the offsets go to the Kafka group, for lag monitoring only.
"""

from __future__ import annotations

import copy
import fcntl
from concurrent.futures import TimeoutError as FuturesTimeout
import json
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from consumers.base import Segment, Source, offsets_array
from consumers.decode import FILTERED, Decoder, ItemSpec
from consumers.kafka_security import redacted
from state_store.audit import AuditKeyError, load_key, write_export
from state_store.failpoints import failpoint, under_tests
from state_store.local import LocalStore, atomic_write

from ..release import make_release, stamp_window
from ..state import PanPrivateHistogram
from .accuracy_plan import StartPlan, warn_if_below_noise
from .anchor import (kafka_metadata, parse_kafka_metadata, release_dir_anchor,
                     write_release_dir_anchor)
from .deadletter import DeadLetterError, DeadLetters, service_producer
from .errors import ServiceError, Stopping
from .event_time import EventTimeWindows
from .intake_gap import IntakeGap
from .next_state import NextState
from .identity import (IDENTITY_DEFAULTS, choose_buckets_for, directory_identity, identity_of,
                       item_identity)
from .ledger import Ledger, LedgerError
from .metrics import Metrics
from .publisher import Backoff as _Backoff
from .publisher import ReleasePublisher
from .rejects import RejectLog, RejectWatch
from .release_gate import ReleaseGate, covered_ranges
from .rollup_closer import RollupCloser, ledgered_unpublished_rollups
from .settings import Config
from .user_window import NO_EXPORT, is_user, new_user_state, user_cells, user_release
from .window import WindowTask, new_window, totals_from

__all__ = ["release_method", "Aggregator", "ServiceError", "Stopping", "service_running"]

log = logging.getLogger("panagg.service")


def release_method(cfg: Config) -> str | None:
    """``release.estimator``: None for the grid's default, else the named estimator."""
    name = cfg.release.estimator
    return None if name == "default" else name


def service_key_error(exc: Exception) -> str:
    """An audit-key problem of the running service, said so that the fix lands in the right
    place: the key is read by the service, not by the shell that asked for the export."""
    return (f"the running service cannot sign the export: {exc}. The key is read by the "
            "service from its own environment or its audit.key_file, not from this shell: set "
            "it there and restart the service")


def remove_created(paths) -> None:
    """Remove ``paths`` (created by a start, in that order) in reverse: the lock file, then
    directories left empty; one that is not empty, or gone, stays as it is."""
    for path in reversed(paths):
        try:
            path.rmdir() if path.name != "service.lock" else path.unlink()
        except OSError:
            pass


def claim_directory(directory: Path, *later: Path):
    """Make ``directory`` and hold its lock (:func:`lock_directory`) for a start. Returns (the
    paths that did not exist before: ``directory``, ``later`` (paths the start makes after
    this) and the lock file, for :func:`remove_created` after a refused start; the open lock
    file)."""
    directory = Path(directory)
    created = [p for p in (directory, *later, directory / "service.lock") if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return created, lock_directory(directory)


def lock_directory(directory: Path):
    """Hold ``directory/service.lock`` (flock) for this process, with its pid inside; one line
    naming the other process if it is held. Returns the open file: closing it unlocks."""
    f = open(Path(directory) / "service.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise ServiceError(f"another panagg (pid {other}) is running on checkpoint.dir "
                           f"{directory}; stop it or use another directory") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


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
    fresh_start
        Allow starting without a checkpoint although the ledger shows earlier releases (the
        open window of the lost checkpoint is then never released; the ledger records it).
    accept_change
        Accept settings that differ from those the state directory was created with, and record
        the change in the ledger.
    """

    def __init__(self, cfg: Config, source: Source, metrics: Metrics | None = None, *,
                 fresh_start: bool = False, accept_change: bool = False,
                 same_records_as: str | None = None):
        self.cfg = cfg = Config.from_mapping(cfg)
        #: --same-records-as: the topic whose records source.topic holds copies of
        self.same_records_as = same_records_as
        self.source = source
        self.metrics = metrics or Metrics()
        st = cfg.state
        self.epsilon = float(st.epsilon)
        self.model, self.loss = st.model, st.loss
        #: state.privacy_unit = user: a density state per window (:mod:`.user_window`)
        self.user = is_user(cfg)
        self.direct = st.mode == "direct" and not self.user
        self.size = (user_cells(cfg) if self.user else int(st.domain_size) if self.direct
                     else choose_buckets_for(cfg))
        self._next_state = NextState(self._draw_state, size=self.size)  # drawn beside the loop
        src = cfg.source
        self.decoder = Decoder(src.format, domain_size=self.size if self.direct else None,
                               max_message_bytes=src.max_message_bytes,
                               max_item_bytes=src.max_item_bytes,
                               spec=ItemSpec.from_config(cfg.item))
        self.dir = Path(cfg.checkpoint.dir)
        self.snapshots_per_window = int(cfg.checkpoint.snapshots_per_window)
        self.fresh_start, self.accept_change = fresh_start, accept_change
        self._lock_file = None
        self.task = WindowTask("all", None)
        #: a name for this aggregation in anchors and charges ("" when it is the only one)
        self.aggregation = cfg.aggregation
        self.anchor_name = self.aggregation.name if self.aggregation else ""
        try:
            self.ledger = Ledger(self.dir / "ledger.jsonl", budget_per_window=cfg.budget_per_window,
                                 budget_total=cfg.ledger.budget_total or None,
                                 budget_per_event=cfg.budget_per_event)
        except LedgerError as exc:
            raise ServiceError(str(exc)) from None
        stream = identity_of(cfg)["stream"]
        #: asks the ledger about the events a release covers (:mod:`.release_gate`)
        self.gate = ReleaseGate(self.ledger, self.metrics, epsilon=self.epsilon, model=self.model,
                                stream=stream, aggregation=self.anchor_name, directory=self.dir,
                                parallel=self.aggregation.parallel if self.aggregation else None)
        self._keep_processing_time()
        cfg = self.cfg  # (the line above may have replaced it)
        #: the start's accuracy plan in the log (a thread simulates the expected errors)
        self.plan = StartPlan(cfg)
        from .config import rollup_spans
        spans = rollup_spans(cfg)
        #: window.rollups (:mod:`.rollup_closer`; sums under dir/rollups), None without them
        self.rollups = RollupCloser(
            self.dir / "rollups", spans, ledger=self.ledger, metrics=self.metrics,
            model=self.model, loss=self.loss, method=release_method(cfg),
            error_bar_reps=int(cfg.release.error_bar_reps),
            stream=stream, aggregation=self.anchor_name, base_kind=cfg.window.kind,
            window_size=cfg.window.size,
            annotate=self._annotate, worker=lambda: self.worker) if spans else None
        self.control = self.dir / "control"
        #: ledger entries a start decided on, written only once every start check has passed
        #: (a refused start writes nothing)
        self._deferred: list[dict] | None = None
        self._checked: list[dict] | None = None  # check_start passed: its ledger entries
        #: a file source's budget registry, read at the start's checks (None: none)
        self._file_registry = None
        seed = cfg.testing.noise_seed
        self._seed = seed if seed >= 0 and under_tests() else None  # (test-only: settings.py)
        self._producer = None
        topic = src.dead_letter_topic
        name = self.aggregation.name if self.aggregation else None
        self.dead_letters = (DeadLetters(topic, self._kafka_producer, self.metrics, name)
                             if topic else None)
        self.stop_event = threading.Event()
        self._export_seq = 0
        self._held: set[str] = set()
        self._connected: bool | None = None
        self.reject_watch = RejectWatch(cfg)
        self.reject_log = RejectLog()
        self._last_lag = 0.0
        self._pause_logged: float | None = None
        self.intake_gap = IntakeGap()  # the longest stall of intake per window
        self._progress_at: float | None = None
        self._progress_events = 0.0
        self.publisher = ReleasePublisher(
            cfg.release.dir, cfg.release.topic, producer=self._kafka_producer,
            key_of=self._release_key, on_published=self._published, plot=cfg.release.plots)
        #: event-time windows (window.kind = event_time; :mod:`.event_time`)
        self.event_time = EventTimeWindows(self)
        self._commit_backoff = _Backoff("checkpoint")
        self._anchor_note_logged = False
        #: the release worker (aggregator.service.release_worker): None releases in the loop;
        #: several aggregations share one (set before start)
        self.worker = None
        self._owns_worker = False
        #: (window, started, ended) of each release the worker computed (wall clock; kept in
        #: the process for latency figures, never in a document)
        self.release_runs: list[tuple[int, float, float]] = []
        #: called once the start succeeded (the CLI leaves the metrics URL for panagg status)
        self.on_started = None
        self.metrics.epsilon.set(self.epsilon)

    # -- noise sources -------------------------------------------------------------------------
    def _keep_processing_time(self) -> None:
        """``window.kind = time`` on Kafka windows by the records' timestamps
        (``window.clock = auto``); a state directory started before that, with windows by this
        process's clock, keeps them (its checkpoints and ledger are processing-time windows)."""
        if not self.cfg.window.auto_event_time:
            return
        started = (self.ledger.identity() or {}).get("window", "")
        if started.startswith("time:"):
            self.cfg = self.cfg.updated({"window": {"kind": "time", "auto_event_time": False,
                                                    "idle_partition_timeout_s": 0.0}})
            log.info("%s counts time windows by this process's clock (it was started so): it "
                     "keeps them; for windows by the records' Kafka timestamps use a new "
                     "checkpoint.dir (or set window.clock = process to say so)", self.dir)

    def _rng(self, *tag):
        """None (OS CSPRNG) in production; a deterministic generator only under PANAGG_TESTING."""
        if self._seed is None:
            return None
        return np.random.default_rng([self._seed, *[int(t) for t in tag]])

    def _new_state(self, task: WindowTask, window_id: int) -> PanPrivateHistogram:
        """Window ``window_id``'s fresh state (drawn ahead, beside the loop: :mod:`.next_state`)."""
        return self._next_state.take(window_id)

    def _draw_state(self, window_id: int) -> PanPrivateHistogram:
        if self.user:
            return new_user_state(self.cfg, self._rng(0, window_id))  # type: ignore[return-value]
        kwargs = {"size": self.size} if self.direct else {"buckets": self.size}
        state = PanPrivateHistogram(self.epsilon, rng=self._rng(0, window_id), **kwargs)
        worker = self.worker  # (this runs beside the loop: the worker may go meanwhile)
        if worker is not None:
            # its counters in a shared block of their own: the close hands over no copy
            state = worker.house(state)
        return state

    def _new_window(self, task: WindowTask, window_id: int) -> dict:
        w = new_window(window_id, self.cfg.window.kind, self.cfg.window.size)
        if w["kind"] == "event_time":
            self.event_time.open_window(task, w)
        return w

    # -- lifecycle -----------------------------------------------------------------------------
    def _lock(self) -> None:
        # what this start creates, removed again if the start is refused (it writes nothing)
        self._created, self._lock_file = claim_directory(self.dir, self.control,
                                                         self.dir / "checkpoints")
        self.control.mkdir(exist_ok=True)

    def _remove_created(self) -> None:
        """After a refused start (the lock released): remove what :meth:`_lock` created, so
        that the directory is as it was (an empty new directory is removed too)."""
        remove_created(getattr(self, "_created", []))
        self._created = []

    def _saved_config(self) -> dict:
        """The config the last start saved in the state directory ({} if none or unreadable)."""
        try:
            saved = json.loads((self.dir / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def save_effective_config(self) -> None:
        """Keep the running config next to the checkpoints, for offline release/export. A
        setting that changed since the last start (those not in the identity are safe to
        change: docs/configuration.md) is logged once, here."""
        from .config import DEFAULTS
        # (scale-out members share the directory, each with its own instance id and port)
        old, new = self._saved_config(), redacted(self.cfg)
        for section in DEFAULTS:
            for key in DEFAULTS[section]:
                was = (old.get(section) or {}).get(key, new[section][key])
                if was != new[section][key] and (section, key) != ("security", "password"):
                    log.info("setting %s.%s changed from %r to %r", section, key, was,
                             new[section][key])
        atomic_write(self.dir / "config.json",  # no secrets
                     json.dumps(redacted(self.cfg), indent=1, sort_keys=True), mode=None)

    def check_identity(self) -> dict:
        """Record the state directory's identity at its first start; refuse (or, with
        ``accept_change``, ledger) a later start with other settings."""
        if not self.aggregation and (self.dir / "aggregations.json").exists():
            # its aggregations' ledgers below hold charges this one would not see
            raise ServiceError(
                f"checkpoint.dir {self.dir} holds several aggregations (also what "
                "window.rollup_design = tree or hybrid runs); use their config (the same "
                "[aggregations] or rollup design) or a new checkpoint.dir")
        mine = dict(identity_of(self.cfg), **directory_identity(self.cfg))
        recorded = self.ledger.identity()
        if recorded is None:
            first = dict(mine, run=os.urandom(8).hex(), first_window=0,
                         start=self.cfg.source.start)
            self._start_append(entry_id=f"identity-{os.urandom(6).hex()}", kind="identity",
                                identity=first)
            return first
        # a ledger from before a key was in the identity: the last start's saved config says
        saved = directory_identity(self._saved_config())
        had = {k: recorded.get(k, saved.get(k, IDENTITY_DEFAULTS.get(k, mine[k]))) for k in mine}
        changed = [k for k in mine if had[k] != mine[k]]
        same = self._same_records_entry(had, mine, changed)
        if not changed:
            return recorded
        what = ", ".join(f"{k} {had[k]!r} -> {mine[k]!r}" for k in changed)
        if not self.accept_change:
            where = ""
            if "release_dir" in changed:
                done = [e["window"] for e in self.ledger.releases()
                        if isinstance(e.get("window"), int)]
                where = (f"; the releases so far ({len(done)}, up to window {max(done)}) are in "
                         f"{had['release_dir']}: a new release.dir would leave a gap there"
                         if done else "")
            raise ServiceError(f"checkpoint.dir {self.dir} belongs to other settings ({what}); "
                               "use the original settings, a new checkpoint.dir, or "
                               f"--accept-change to record the change in the ledger{where}")
        self._start_append(entry_id=f"identity-{os.urandom(6).hex()}", kind="identity",
                            identity=dict(recorded, **mine), previous=recorded,
                            note=f"settings changed: {what}", **same)
        log.warning("settings of %s changed and recorded in the ledger: %s", self.dir, what)
        if "stream" in changed:
            self._say_stream_changed(had["stream"], mine["stream"], same)
        return dict(recorded, **mine)

    def _same_records_entry(self, had: dict, mine: dict, changed: list) -> dict:
        """``--same-records-as OLD`` checked against the change (one line if it does not fit),
        as the identity entry's field: the new topic's records are copies of OLD's."""
        old = self.same_records_as
        if not old:
            return {}
        if self.cfg.source.kind != "kafka":
            raise ServiceError("--same-records-as applies to a Kafka source.topic only; a file "
                               "source is recognised by its content (ledger.file_registry)")
        if "stream" not in changed:
            raise ServiceError(f"--same-records-as {old}: source.topic did not change "
                               f"({mine['stream'][6:]}); give it with --accept-change when "
                               "source.topic changes from that topic")
        if had["stream"] != f"kafka:{old}":
            counted = had["stream"].removeprefix("kafka:")
            raise ServiceError(f"--same-records-as {old}: {self.dir} counted topic {counted}, "
                               f"not {old}; name the topic it counted")
        return {"same_records_as": {"from": old, "to": self.cfg.source.topic}}

    def _say_stream_changed(self, was: str, now: str, same: dict) -> None:
        """The warning line of a changed source: what the new records are charged as."""
        if same:
            log.warning("source.topic changed (%s -> %s) with --same-records-as %s: every "
                        "record of %s is charged as the most-charged record of %s (the copy's "
                        "offsets need not match), so copies of released records are refused, "
                        "not released again", was[6:], now[6:], same["same_records_as"]["from"],
                        now[6:], was[6:])
        elif self.cfg.source.kind == "kafka":
            log.warning("source.topic changed (%s -> %s) without --same-records-as: its "
                        "records count as new data, and copies of released records in it are "
                        "released again (the ledger and the budget registry know positions, not "
                        "contents); if it holds the same records, stop and start again with "
                        "--accept-change --same-records-as %s", was[6:], now[6:], was[6:])
        elif self.cfg.source.kind == "file" and self.cfg.ledger.file_registry:
            log.warning("source.path changed (%s -> %s): its records are charged by the "
                        "file's content (ledger.file_registry), so a renamed or moved copy of "
                        "the file read before keeps its charges", was[5:], now[5:])
        else:
            log.warning("the counted stream changed (%s -> %s): its positions are new ones, so "
                        "records it holds that are copies of released ones count as new data "
                        "and are released again (ledger.file_registry = \"\": nothing knows "
                        "the file's content; docs/privacy.md section 22)", was, now)

    def check_start(self) -> None:
        """Every check of a start, before anything is written; the ledger entries they make
        wait for :meth:`restore`. (Several aggregations run all their checks before any of them
        writes: one refused refuses the start, which then wrote nothing.)"""
        task = self.task
        task.store = LocalStore(self.dir / "checkpoints")
        self._deferred = []
        try:
            self._prepare_file_registry()
            self.check_anchors(task.store.load_latest())
            self.check_identity()
            self.restore_task(task, where=str(task.store.dir), commit=False)
            self._carry_renamed_file(task)
            self.check_replayable(task)
            self._checked, self._deferred = self._deferred, None
        except BaseException:
            self._deferred = None
            raise

    def restore(self) -> None:
        """Load the checkpoint (or start the first window) and seek the source there. Every
        check runs before anything is written: a refused start leaves the directory as it was."""
        if self._checked is None:
            self.check_start()
        task = self.task
        deferred, self._checked = self._checked, None
        for entry in deferred:
            self._ledger_append(**entry)
        moved = task.durable is None or task.durable.window.get("uid") != task.window.get("uid")
        if moved and not task.queue and task.close_at is None:
            self.commit(task)  # from now on a missing checkpoint is a lost one
        self.source.seek(task.offsets)
        # the totals of the checkpoint, then every record after it once: exact after restarts
        self.metrics.events.inc(task.totals["events"])
        for reason, count in task.totals["rejects"].items():
            self.metrics.decode_errors.labels(reason=reason).inc(count)
        self.metrics.filtered.inc(task.totals.get("filtered", 0))
        self.metrics.window_id.set(task.window["id"])
        self.metrics.window_events.set(task.window["events"])
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
        # a rollup ledgered but not yet published is published from the ledger; views kept
        # before a stop are folded (each once)
        ledgered_unpublished_rollups(self.ledger, self.cfg.release.dir, task.pending)
        if self.rollups is not None:
            self.rollups.fold(task.pending)

    def restore_task(self, task: WindowTask, *, where: str, commit: bool = True) -> None:
        """Resume ``task`` from its latest checkpoint (see :mod:`.window`): a fresh state (or
        the checkpoint's snapshot plus a fresh layer), the window, offsets and totals. A window
        the ledger already decided (released or refused) is not replayed: the next window
        starts at its ledgered end. ``commit=False``: the caller commits once its checks pass."""
        ckpt = task.store.load_latest()
        if ckpt is None:
            self._first_start(task, where)
            if commit:
                self.commit(task)  # from now on a missing checkpoint is a lost one
            return
        self._check_start_policy(where)
        self._check_not_rolled_back(ckpt.window, where)
        task.window, task.offsets = dict(ckpt.window), dict(ckpt.offsets)
        task.pending = list(ckpt.pending)
        task.totals = totals_from(ckpt.totals)
        task.window.setdefault("uid", f"v1-{task.name}-{task.window['id']}")
        task.window.setdefault("snapshots", 0)
        # checkpoints from before source ranges: the window starts at the checkpoint's offsets
        # (a snapshot's are mid-window: its partitions' first records then mark the start)
        task.window.setdefault("start_offsets", dict(ckpt.offsets) if ckpt.state is None else {})
        task.window.setdefault("lineage", f"legacy-{(self.ledger.identity() or {}).get('run')}")
        task.durable, task.replay = ckpt, None
        task.queue, task.inflight = [], []
        if ckpt.unreleased:
            self._queue_unreleased(task, ckpt)
        elif self._skip_decided_window(task):
            if commit:
                self.commit(task)
            return
        task.mark_start()
        if ckpt.state is None:
            task.state = self._new_state(task, task.window["id"])
        else:
            task.state = PanPrivateHistogram.deserialize(ckpt.state)
            self._check_state_matches_config(task.state, f"the checkpoint in {where}",
                                             size=self._expected_size(task))
            # the restored memory must not equal the file plus exact increments
            task.state.rerandomize(rng=self._rng(3, task.window["id"], ckpt.seq))
            # where this window's records start is behind the snapshot (and the totals there
            # are not known): its close runs in the loop, which needs neither
            task.window_start = None
        if task.close_at is None:
            self._replay_target(task)
        # what the restart costs (docs/privacy.md, R3): the events counted after this checkpoint
        # before the stop are counted again under fresh noise
        self._ledger_append(entry_id=f"restart-{os.urandom(6).hex()}", kind="restart",
                            window=task.window["id"], window_uid=task.window["uid"],
                            model=self.model, replay_from=dict(task.offsets), unit=task.name,
                            note="events after replay_from counted again under fresh noise; "
                                 "2 eps for them against an intruder who read memory before "
                                 "the restart")
        log.info("restored checkpoint %d of %s: window %s from %d partition offset(s)%s; the "
                 "window's later events are replayed from the source under fresh noise",
                 ckpt.seq, task.name, task.window["id"], len(task.offsets),
                 " and a layered snapshot" if ckpt.state is not None else "")

    def _queue_unreleased(self, task: WindowTask, ckpt) -> None:
        """The checkpoint lists closed windows whose release was not ledgered when it was
        written (releases beside the loop): replay each from its start to its recorded end and
        close it, then the open window. Those the ledger holds by now are not replayed: the
        replay starts at the end of the last of them."""
        queue = [dict(u) for u in ckpt.unreleased] + [{"window": dict(ckpt.window),
                                                       "end_offsets": None}]
        while len(queue) > 1:
            uid = queue[0]["window"]["uid"]
            entry = self.ledger.get(f"release-{uid}") or self.ledger.get(f"refused-{uid}")
            if entry is None:
                break
            if entry["kind"] == "release" and entry["document"] not in task.pending:
                task.pending.append(entry["document"])
            head = queue.pop(0)
            task.offsets = dict(task.offsets, **{p: int(o) for p, o in
                                                  head["end_offsets"].items()})
            task.totals = totals_from(head["totals"])
        first = queue.pop(0)
        task.window = dict(first["window"], events=0)
        task.close_at = ({p: int(o) for p, o in first["end_offsets"].items()}
                         if first.get("end_offsets") is not None else None)
        task.queue = queue
        closed = (task.close_at is not None) + sum(q.get("end_offsets") is not None
                                                    for q in queue)
        log.info("%d closed window(s) of %s were not released when the service stopped: each "
                 "is replayed from the source and released once", closed, task.name)

    def _skip_decided_window(self, task: WindowTask) -> bool:
        """If the ledger already holds the restored window's release (or refusal) with its end
        positions and totals (a stop between the ledger entry and the checkpoint that starts the
        next window), start the next window at that end instead of replaying this one: a replay
        would put the window's events in memory under fresh noise beside the published release
        of the old noise (two looks at them). True if skipped."""
        uid = task.window["uid"]
        entry = self.ledger.get(f"release-{uid}") or self.ledger.get(f"refused-{uid}")
        if entry is None or entry.get("end_offsets") is None or entry.get("totals") is None:
            return False
        wid = task.window["id"]
        if task.window["kind"] == "event_time":
            if not self.event_time.skip_decided_window(task, entry):
                return False
            if entry["kind"] == "release" and entry["document"] not in task.pending:
                task.pending.append(entry["document"])
            log.info("window %s of %s is in the ledger already (%s): it is not replayed; window "
                     "%s starts after it", wid, task.name, entry["kind"], wid + 1)
            return True
        if entry["kind"] == "release" and entry["document"] not in task.pending:
            task.pending.append(entry["document"])
        ends = {p: int(o) for p, o in entry["end_offsets"].items()}
        task.offsets = dict(task.offsets, **ends)
        task.totals = totals_from(entry["totals"])
        lineage = task.window["lineage"]
        task.window = self._new_window(task, wid + 1)
        task.window.update(lineage=lineage, start_offsets=dict(task.offsets))
        task.mark_start()
        task.state = self._new_state(task, wid + 1)
        task.close_at = None
        log.info("window %s of %s is in the ledger already (%s): it is not replayed; window %s "
                 "starts at its end", wid, task.name, entry["kind"], wid + 1)
        return True

    def check_anchors(self, ckpt) -> None:
        """Refuse a ledger older than a head recorded outside it: in the checkpoint, in the
        release directory, in the Kafka group's committed offsets (:mod:`.anchor`)."""
        anchors = []
        if ckpt is not None and ckpt.ledger_head:
            anchors.append((f"checkpoint {ckpt.seq}", ckpt.ledger_head))
        from state_store.registry import ledger_id
        rel = release_dir_anchor(self.cfg.release.dir, self.ledger.path,
                                 ledger_id(self.ledger.entries))
        if rel is not None and rel.get("unreadable"):
            raise ServiceError(f"the ledger anchor {rel['where']} is unreadable; restore it "
                               "from a backup (it records how far the ledger had come)")
        if rel is not None:
            anchors.append((rel["where"], rel))
        probe = getattr(self.source, "committed_metadata", None)
        kafka = [parse_kafka_metadata(m).get(self.anchor_name) for m in (probe() if probe else [])]
        kafka = [h for h in kafka if h]
        if kafka:
            anchors.append((f"the committed offsets of group {self.cfg.source.group!r}",
                            max(kafka, key=lambda h: h["seq"])))
        elif probe is None and not self._anchor_note_logged:
            self._anchor_note_logged = True
            log.info("the privacy ledger is anchored in the checkpoint and in release.dir only "
                     "(no Kafka group): a state directory restored together with release.dir "
                     "from one backup cannot be detected")
        for where, head in anchors:
            problem = self.ledger.anchor_problem(head)
            if problem and ckpt is None and not self.ledger.path.exists() \
                    and where.startswith("the committed offsets of group"):
                # a new directory on a group another one used: not only a lost ledger
                raise ServiceError(
                    f"checkpoint.dir {self.dir} is new, but consumer group "
                    f"{self.cfg.source.group!r} has committed offsets of a state directory "
                    f"whose ledger had {head['seq']} entries: another state directory (or a lost "
                    "one) counted this topic. Use that state directory (restore it from a backup "
                    "if it was lost), or another source.group to count the topic anew")
            if problem:
                raise ServiceError(
                    f"{problem} (its head, entry {head['seq']}, is recorded in {where}); the "
                    "ledger is the record of privacy spent: restore the latest ledger and state "
                    "directory; without them the events it charged would be released again")

    def check_replayable(self, task: WindowTask) -> None:
        """Refuse to start if the source could not replay ``task``'s open window after a crash
        (the checkpoint holds no counters: the source is the open window's only copy)."""
        probe = getattr(self.source, "replay_problem", None)
        if probe is None:
            return
        w = self.cfg.window
        problem = probe(dict(task.offsets),
                        w.size if w.kind in ("time", "event_time") else None)
        if problem:
            raise ServiceError(problem)

    def _expected_size(self, task: WindowTask) -> int:
        return self.size

    def _first_start(self, task: WindowTask, where: str) -> None:
        released = [e for e in self.ledger.entries if e["kind"] in ("release", "refused")]
        first = 0
        committed = getattr(self.source, "committed_offsets", lambda: {})()
        if committed and not released and not self.fresh_start:
            raise ServiceError(
                f"no checkpoint in {where}, but consumer group {self.cfg.source.group!r} "
                "has committed offsets: another state directory (or a lost one) counted this "
                "topic. Use that state directory, another source.group, or --fresh-start to "
                "count from the committed offsets")
        if released:
            if not self.fresh_start:
                raise ServiceError(
                    f"no checkpoint in {where}, but the ledger in {self.dir} records "
                    f"{len(released)} release(s): the checkpoint was lost or moved away. Restore "
                    "it from a backup, or start with --fresh-start (the window it held is then "
                    "never released)")
            first = max(int(e["window"]) for e in released
                        if isinstance(e.get("window"), int)) + 1
        task.window = self._new_window(task, first)
        task.state = self._new_state(task, first)
        task.offsets, task.pending = {}, []
        task.totals = {"events": 0, "rejects": {}}
        task.durable = None
        task.offsets, at = self._start_offsets(bool(committed))
        # never over positions whose events this release would charge past the budget (a
        # fresh start, an aggregation renamed or added under --accept-change)
        resume = self.ledger.charges(self.gate.other_charges()).resume_offsets(
            self.epsilon, budget=self.ledger.budget_per_event)
        registry = getattr(self, "_file_registry", None)
        if registry is not None:  # the same content read before (renamed, another state dir)
            theirs = registry.resume_offsets(self.epsilon, budget=self.ledger.budget_per_event)
            for part, pos in theirs.items():
                if pos > resume.get(part, 0):
                    resume[part] = pos
                    log.warning(
                        "%s was read and released before (by %s, the budget registry %s): "
                        "counting starts after its last released position %d", part[5:],
                        registry.who(registry.translate({part: [0, pos]}),
                                     registry.charges(set())), registry.topic, pos)
        floor = dict(committed) if committed and self.fresh_start else {}
        floor.update(task.offsets)
        later = {p: o for p, o in resume.items() if o > floor.get(p, 0)}
        if later:
            task.offsets.update(later)
            at = ("after the last released position (" + ", ".join(
                f"{k} at {v}" for k, v in sorted(later.items())) + f"), not at {at}")
        task.window.update(lineage=os.urandom(8).hex(), start_offsets=dict(task.offsets))
        task.mark_start()
        if released:
            self._start_append(entry_id=f"fresh-start-{os.urandom(6).hex()}", kind="fresh-start",
                                window=first, resume_offsets=dict(floor, **task.offsets),
                                note=f"started without a checkpoint in {where}; counting "
                                     f"resumes {at}")
            log.warning("fresh start without a checkpoint in %s: numbering continues at window "
                        "%d", where, first)
        log.info("no checkpoint in %s: starting window %d at %s", where, first, at)

    def _start_offsets(self, committed: bool) -> tuple[dict[str, int], str]:
        """Where a new state directory starts (``source.start``), and that in words."""
        from .config import parse_start
        src = self.cfg.source
        start = parse_start(src.start) if src.kind == "kafka" else "earliest"
        if start == "earliest":
            return {}, ("the group's committed offsets (--fresh-start)" if committed and
                        self.fresh_start else "the earliest retained records" if
                        src.kind == "kafka" else "the start of the input")
        probe = getattr(self.source, "initial_offsets", None)
        offsets = probe(start) if probe is not None else None
        if not offsets:
            raise ServiceError(f"source.start = {src.start}: the partitions of topic "
                               f"{src.topic!r} are not known (does it exist?); create the "
                               "topic, or start from earliest")
        where = ", ".join(f"{k} at {v}" for k, v in sorted(offsets.items()))
        what = "the latest offsets" if start == "latest" else \
            f"the first records at or after {src.start}"
        return offsets, f"{what} (source.start): {where}"

    def _check_start_policy(self, where: str) -> None:
        """``source.start`` only places a new state directory; refuse one that asks for another
        start than the directory had (it resumes from its checkpoint: the setting would be
        silently ignored)."""
        from .config import parse_start
        wanted = self.cfg.source.start
        if parse_start(wanted) == "earliest":
            return
        had = (self.ledger.identity() or {}).get("start", "earliest")
        if parse_start(had) != parse_start(wanted):
            raise ServiceError(f"source.start = {wanted} only places a new state directory, but "
                               f"{where} has a checkpoint (this directory started at {had}) and "
                               "resumes from its offsets; for a new start at "
                               f"{wanted} use a new checkpoint.dir, or remove source.start")

    def _check_not_rolled_back(self, window: dict, where: str) -> None:
        uid = window.get("uid")
        later = [e for e in self.ledger.releases()
                 if isinstance(e.get("window"), int) and e["window"] >= window["id"]
                 and e.get("window_uid") != uid and self._same_unit(e)]
        if later:
            raise ServiceError(
                f"the checkpoint in {where} is older than the ledger: it is at window "
                f"{window['id']}, the ledger has window {later[-1]['window']} released. Restore "
                "the latest checkpoint (a rolled-back one would re-release windows), or start "
                "with --fresh-start after moving it away")

    def _same_unit(self, entry: dict) -> bool:
        return True

    def _replay_target(self, task: WindowTask) -> None:
        """Where replaying the restored window must stop before it closes: the ledgered end of a
        window already released, or (time windows whose end passed while down) the source's
        end offsets now."""
        entry = self.ledger.get(f"release-{task.window['uid']}")
        if entry is not None and entry.get("end_offsets") is not None:
            task.close_at = {p: int(o) for p, o in entry["end_offsets"].items()}
        elif task.window["kind"] == "time" and task.progress() >= 1:
            ends = self._end_offsets(task)
            task.close_at = ends if ends else None

    def _end_offsets(self, task: WindowTask) -> dict[str, int] | None:
        end_offsets = getattr(self.source, "end_offsets", None)
        return end_offsets() if end_offsets else None

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        """Consume until stopped (stop_event / SIGTERM), or until a finite source is exhausted."""
        self._lock()
        started = failed = False
        try:
            self.start()
            started = True  # a refused start says why in one line, not "stopped" before it
            if self.on_started is not None:
                self.on_started()
            idle_since = None
            finite = self.cfg.source.kind != "kafka"
            while not self.stop_event.is_set():
                if self._paused_for_budget(poll_timeout_s, finite):
                    continue
                self.intake_gap.polling()
                segments = self.source.poll(poll_timeout_s)
                self.intake_gap.polled()
                self.turn(segments)
                if segments:
                    idle_since = None
                    continue
                if self.source.exhausted:
                    self.input_ended()
                    break
                # only an --exit-when-idle run asks (the check may wait on the broker)
                if idle_exit_s is None or not self.idle_can_count():
                    continue
                idle_since = idle_since or time.monotonic()
                if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                    break
            self.finish()
        except Stopping:
            log.info("stopped while waiting; the open window is replayed at the next start")
        except BaseException:
            failed = True
            raise
        finally:
            self.close()
            if started:
                self._stop_line("on the error below" if failed else None)
            else:
                self._remove_created()

    # The loop's steps, also driven one by one by aggregator.service.multi (several aggregations
    # fed by one consumer): start, then per poll a turn, then input_ended (finite input) and finish.
    def start(self) -> None:
        """Restore the checkpoint, seek the source, publish what a crash left pending."""
        self.restore()
        self._attach_registry()
        self.save_effective_config()
        if self.worker is None and self.async_releases():
            from .release_worker import ReleaseWorker
            self.worker = ReleaseWorker(int(self.cfg.release.workers))
            self._owns_worker = True
        self._ledger_composition()
        w = self.cfg.window
        if w.auto_event_time:
            log.info("time windows of %g s by the records' Kafka timestamps (window.clock = "
                     "auto): an event lands in the window of its timestamp, after a broker "
                     "outage too; window.clock = process windows by this process's clock",
                     w.size)
        self.plan.start()
        self._publish_pending(self.task)

    def _ledger_composition(self) -> None:
        """With several aggregations: the set this one is part of, in its ledger, whenever it
        differs from the last one recorded (docs/privacy.md, section 19)."""
        if not self.aggregation:
            return
        agg = self.aggregation
        # as the ledger's JSON has it (a list), so that the same set compares equal
        mine = {"of": list(agg.of), "budget_per_event": agg.budget_per_event,
                "epsilon_per_event": agg.epsilon_per_event}
        note = (f"aggregation {agg.name!r} of {', '.join(agg.of)}: each event spends up to "
                f"{agg.epsilon_per_event:g} eps over them")
        if agg.parallel:  # a breakdown's key: one parallel composition with the other keys
            mine["parallel"] = dict(agg.parallel)
            note = (f"key {agg.name!r} of {agg.parallel['group']} ({len(agg.of)} keys), one "
                    "parallel composition: an event is in its key's state only, so each event "
                    f"spends {agg.epsilon_per_event:g} eps over all keys' releases, not one "
                    "charge per key (docs/privacy.md section 24)")
        last = [e for e in self.ledger.entries if e["kind"] == "composition"]
        if last and last[-1].get("composition") == mine:
            return
        self._ledger_append(entry_id=f"composition-{os.urandom(6).hex()}", kind="composition",
                            window=self.task.window["id"], composition=mine, note=note)

    def turn(self, segments) -> None:
        """Count one poll's segments, then the turn's housekeeping."""
        for seg in segments:
            self._ingest(seg)
        self.housekeeping(polled=bool(segments))

    def housekeeping(self, polled: bool) -> None:
        """After a poll's records are counted (``polled``: whether there were any): time
        windows, snapshots, control requests, publishing, lag, health."""
        if not polled:
            self.plan.idle()   # caught up: the start's simulated plan may take its CPU now
            self._caught_up(self.task)
        self._maybe_close_time_window(self.task)
        if self.cfg.window.kind == "event_time":
            self.event_time.turn(self.task)
        self._maybe_snapshot(self.task)
        if self.task.inflight:
            self._collect_releases(self.task)
        if self.rollups is not None and self.rollups.jobs:
            self.rollups.collect(self.task.pending)
        self._handle_control()
        if self.task.pending:
            self._publish_pending(self.task)
        self._update_lag()
        self._turned()

    def input_ended(self) -> None:
        """A finite source delivered everything: release the open window (release.on_exhausted)."""
        # (an event-time window's close can start the next one with events)
        while self.cfg.release.on_exhausted and self.task.window["events"] > 0:
            self.close_window()
        problem = self.reject_watch.fatal()
        if problem:  # a finite run that counted nothing must not exit 0
            raise ServiceError(problem)

    def finish(self) -> None:
        """Publish what is pending; a run must not end looking successful if it could not."""
        if self.task.inflight:  # a finite run's last windows: wait for their releases
            self._collect_releases(self.task, wait=True)
        if self.rollups is not None and self.rollups.jobs:
            self.rollups.collect(self.task.pending, wait=True)
        if self.task.pending:
            self.publisher.retry_now(wait_s=10.0)
            self._publish_pending(self.task)
        if self.task.pending:
            raise ServiceError(
                f"{len(self.task.pending)} release(s) could not be published "
                f"({self.publisher.last_reason}); they stay in the checkpoint and are "
                "published at the next start once the cause is fixed")

    def idle_can_count(self) -> bool:
        """Whether a turn without records counts towards --exit-when-idle: not before the
        consumer group has assigned this process partitions and it has read them to their end
        (a rebalance or a slow first fetch is not an idle stream)."""
        assigned = getattr(self.source, "assigned", None)
        if assigned is None:  # file and generator sources
            return True
        if not assigned:
            return False
        probe = getattr(self.source, "caught_up", None)
        # partitions waiting at a later event-time window are held there, not behind
        return probe is None or bool(probe(sorted(set(assigned) - set(self._held)))) \
            if set(assigned) - set(self._held) else True

    def _stop_line(self, reason: str | None = None) -> None:
        """What a restart will find: the last checkpoint and what is replayed from it."""
        task = getattr(self, "task", None)
        win = getattr(task, "window", None) or {}
        durable = getattr(task, "durable", None)
        reason = reason or ("stop requested" if self.stop_event.is_set() else "input ended or idle")
        if not win:
            log.info("stopped (%s)", reason)
            return
        where = ""
        if durable is not None:
            where = (f" (checkpoint {durable.seq}, at offsets "
                     f"{', '.join(f'{k}: {v}' for k, v in sorted(durable.offsets.items()))})")
        log.info("stopped (%s): window %s open with %s events; the last checkpoint holds its "
                 "start%s, so the next start replays it from the source", reason, win.get("id"),
                 f"{int(win.get('events', 0)):,}", where)

    def catch_up(self, timeout_s: float = 120.0) -> None:
        """Count what the source holds now (the open window's replay, then anything newer),
        for offline commands that act on the window of a stopped service."""
        deadline = time.monotonic() + timeout_s
        while True:
            segments = self.source.poll(0.5)
            for seg in segments:
                self._ingest(seg)
            self._maybe_snapshot(self.task)  # the same public schedule as the live loop
            if segments:
                continue
            if self.source.exhausted:
                return
            probe = getattr(self.source, "caught_up", None)
            assigned = sorted(set(getattr(self.source, "assigned", ()) or ()) - self._held)
            if probe is None or (assigned and probe(assigned)) or (self._held and not assigned):
                return  # (partitions held at a later event-time window are not behind)
            if time.monotonic() > deadline:
                raise ServiceError(f"could not replay the open window from the source within "
                                   f"{timeout_s:.0f} s; is the broker at "
                                   f"{self.cfg.source.bootstrap} reachable?")

    def _attach_registry(self) -> None:
        """A Kafka source: the cluster's budget registry (``ledger.registry_topic``;
        state_store/registry.py) is read before every release and gets every charge."""
        cfg = self.cfg
        # (several aggregations read the source through a view of the one consumer's hub)
        source = getattr(getattr(self.source, "hub", None), "source", self.source)
        if self.gate.registry is not None:
            return
        if cfg.source.kind == "file":
            if self._file_registry is not None:
                self.gate.attach_registry(self._file_registry)
            return
        if not getattr(source, "is_kafka", False) or not cfg.ledger.registry_topic:
            return
        from consumers.kafka_security import client_options
        from state_store.registry import KafkaBudgetRegistry, RegistryError

        reg = KafkaBudgetRegistry(cfg.source.bootstrap, cfg.ledger.registry_topic,
                                  {"state_dir": str(self.dir.resolve()),
                                   "consumer_group": cfg.source.group},
                                  security=client_options(cfg.security),
                                  timeout_s=float(cfg.source.connect_timeout_s))
        try:
            reg.open()
            self.gate.attach_registry(reg)
        except RegistryError as exc:
            reg.close()
            raise ServiceError(str(exc)) from None

    def _carry_renamed_file(self, task: WindowTask) -> None:
        """A file source renamed or moved (``--accept-change`` on ``source.path``) whose content
        is the one this state directory read (the same content identity in its ledger): the
        checkpoint's positions of the old name are the new name's, so counting resumes where it
        was instead of counting the file again."""
        cids = dict(self.gate.sources)
        if not cids or self._file_registry is None:
            return
        (part, cid), = cids.items()
        same = self._file_registry._aliases | {cid}
        old = {p for e in self.ledger.entries for p, c in (e.get("sources") or {}).items()
               if c in same and p != part}
        for name in sorted(old):
            if name in task.offsets and part not in task.offsets:
                task.offsets[part] = task.offsets[name]
                starts = task.window.get("start_offsets")
                if isinstance(starts, dict) and name in starts:
                    starts[part] = starts[name]
                log.warning("%s has the content %s read as %s (ledger.file_registry): counting "
                            "resumes at its position %d", part[5:], self.dir, name[5:],
                            task.offsets[part])

    def _prepare_file_registry(self) -> None:
        """A file source: read the registry file (``ledger.file_registry``), keyed by the input's
        content, so a renamed, moved or grown file, or one read from a new state directory,
        keeps its charges (state_store/registry.py, FileBudgetRegistry). Nothing is written
        before the start's checks passed (:meth:`_attach_registry`)."""
        from state_store.registry import (FileBudgetRegistry, RegistryError,
                                          default_file_registry)
        self._file_registry = None
        if self.cfg.source.kind != "file":
            return
        from consumers.file_source import FileSource
        source = getattr(getattr(self.source, "hub", None), "source", self.source)
        where = self.cfg.ledger.file_registry
        if not where or not isinstance(source, FileSource) or source.path == "-":
            return  # (records fed by the caller, aggregator.api: no file to know)
        path, part = source.path, source.partition
        where = default_file_registry() if where == "auto" else where
        reg = FileBudgetRegistry(where, {"state_dir": str(self.dir.resolve()),
                                         "file": str(Path(path).resolve())})
        try:
            reg.open()
            cid = reg.identify(part, path)
        except RegistryError as exc:
            raise ServiceError(str(exc)) from None
        except OSError as exc:
            raise ServiceError(f"{path} cannot be read ({exc.strerror or exc})") from None
        if cid is None:
            return  # an empty file: nothing to charge yet (its identity is taken when it has)
        self.gate.sources = {part: cid}
        self._file_registry = reg

    def close(self) -> None:
        if self.gate.registry is not None:
            self.gate.registry.close()
        self.plan.close()
        self.publisher.close()
        if self.worker is not None and self._owns_worker:
            self.worker.close()  # releases not collected are replayed at the next start
            self.worker = None
        if self.dead_letters is not None:
            self.dead_letters.close()
        if self._producer is not None:
            try:
                self._producer.flush(timeout=5)
                self._producer.close(timeout=5)
            except Exception:
                pass
            self._producer = None
        self.source.close()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    # -- counting ------------------------------------------------------------------------------
    def _ingest(self, seg: Segment) -> None:
        if not len(seg):
            return
        if self.cfg.window.kind == "event_time":
            self.event_time.ingest(seg)
            return
        items, good, rejected = self._decode(seg)
        self._count_segment(self.task, seg, items, good, rejected, self.close_window)

    def _decode(self, seg: Segment):
        """(items, record index of each item or None when all are good, rejected records).

        Never raises for one record's sake: whatever a record makes the decoder do, the record
        becomes a reject with a reason (and a dead letter)."""
        decoded = self._parse(seg)
        # records the item filter left out ride along as FILTERED: not events, not rejects
        bad = [r for r in decoded.rejected if r[1] != FILTERED]
        self.reject_watch.observe(seg.values, bad, len(decoded.rejected) - len(bad))
        if not decoded.rejected:
            return decoded.items, None, []
        for i, reason in bad:
            self.reject_log.record(seg.partition, seg.offsets[i], reason)
            if self.dead_letters is not None:
                self.dead_letters.send(seg.partition, seg.offsets[i], seg.values[i], reason,
                                       key=seg.keys[i] if seg.keys is not None else None)
        keep = np.ones(len(seg), dtype=bool)
        keep[[i for i, _ in decoded.rejected]] = False
        return decoded.items, np.flatnonzero(keep), decoded.rejected

    def _parse(self, seg: Segment):
        """The decoder's result for ``seg`` (no logs, metrics or dead letters)."""
        try:
            return self.decoder.decode(seg.values, seg.keys, seg.headers)
        except Exception as exc:  # a decoder bug on odd input: classify records one by one
            log.error("batch decoder failed (%s) on partition %s at offset %d; decoding its "
                      "records one by one", type(exc).__name__, seg.partition, seg.offsets[0])
            return self.decoder.decode_each(seg.values, seg.keys, seg.headers)

    def _count_segment(self, task: WindowTask, seg: Segment, items, good, rejected,
                       close) -> None:
        """Count ``seg`` into ``task``: its good ``items`` (from records ``good``; None: every
        record) and its ``rejected`` records, closing the window (``close()``) when a count
        window fills or a replay reaches its target, so that each window holds exactly its
        records and the offsets always match the counters and the reject totals."""
        offsets = offsets_array(seg.offsets)
        m, k = len(offsets), len(items)
        good_idx = np.arange(k) if good is None else np.asarray(good, dtype=np.int64)
        rej_idx = np.asarray([i for i, _ in rejected], dtype=np.int64)
        rej_reason = [r for _, r in rejected]
        j = rec = 0  # next item to count; records before ``rec`` are accounted for
        while True:
            target = task.close_at.get(seg.partition) if task.close_at else None
            if task.close_at and target is None:
                # a replayed window counted nothing of this partition (it was first read in a
                # later window): hold it where it is until the window closes
                target = int(offsets[0])
            rec_limit = m if target is None else int(np.searchsorted(offsets, target))
            take = max(0, int(np.searchsorted(good_idx, rec_limit)) - j)
            room = task.room()
            if room is not None:
                take = min(take, room)
            if take:
                self._count(task.state, items[j:j + take])
                j += take
                task.window["events"] += take
                task.totals["events"] += take
                self.metrics.events.inc(take)
                self._window_gauges(task)
            full = room is not None and task.room() == 0
            # a full window ends right after its last item; later records are the next one's
            upto = int(good_idx[j - 1]) + 1 if full and j else rec_limit
            self._account(task, seg.partition, offsets, rej_idx, rej_reason, rec, upto)
            rec = max(rec, upto)
            if self._closed_or_held(task, seg.partition, offsets, rec, close, full):
                continue
            return

    def _closed_or_held(self, task: WindowTask, partition: str, offsets, rec: int, close,
                        full: bool = False) -> bool:
        """After a segment's records before ``rec`` are in: close the window if it is ``full``
        or a replay reached its target (True: the segment's rest goes on in the next window);
        else hold the partition at ``rec`` if it reached its replay target before the others."""
        if full or (task.close_at is not None and task.reached(task.close_at)):
            close()
            self._release_held()
            return rec < len(offsets)
        if rec < len(offsets):
            self._hold(partition, int(offsets[rec]))
        return False

    def _reject(self, seg: Segment, i: int, reason: str, reasons: dict) -> None:
        """Record ``i`` of ``seg`` is rejected for ``reason`` (log by position, dead letter)."""
        reasons[i] = reason
        self.reject_log.record(seg.partition, seg.offsets[i], reason)
        if self.dead_letters is not None:
            self.dead_letters.send(seg.partition, seg.offsets[i], seg.values[i], reason,
                                   key=seg.keys[i] if seg.keys is not None else None)

    def _account(self, task: WindowTask, partition: str, offsets, rej_idx, rej_reason,
                 lo: int, hi: int) -> None:
        """Records [lo, hi) of the segment are now in the task: move its offset past them and
        add their rejects to the totals (exactly once, like the events)."""
        if hi <= lo:
            return
        # a partition the window had no start for (a first start from the earliest record):
        # its first record here is where the window's range begins
        task.window.setdefault("start_offsets", {}).setdefault(partition, int(offsets[lo]))
        task.offsets[partition] = int(offsets[hi - 1]) + 1
        a, b = np.searchsorted(rej_idx, [lo, hi])
        if b > a:
            counts: dict[str, int] = {}
            for reason in rej_reason[a:b]:
                counts[reason] = counts.get(reason, 0) + 1
            skipped = counts.pop(FILTERED, 0)
            if skipped:
                task.totals["filtered"] = task.totals.get("filtered", 0) + skipped
                self.metrics.filtered.inc(skipped)
            for reason, count in counts.items():
                self.metrics.decode_errors.labels(reason=reason).inc(count)
            task.count_rejects(counts)

    def _hold(self, partition: str, offset: int) -> None:
        """Stop reading ``partition`` at ``offset`` until the window closes (the other
        partitions are still replaying towards their targets)."""
        seek = getattr(self.source, "seek_partition", None)
        if seek is None:
            return
        self.source.pause([partition])
        seek(partition, offset)
        self._held.add(partition)

    def _release_held(self) -> None:
        if self._held:
            self.source.resume(sorted(self._held))
            self._held.clear()

    def _window_gauges(self, task: WindowTask) -> None:
        self.metrics.window_events.set(task.window["events"])
        if task.window["kind"] == "count":
            self.metrics.window_progress.set(task.progress())

    def _count(self, state: PanPrivateHistogram, items) -> None:
        if self.direct:
            state.add_indices(np.asarray(items, dtype=np.int64))  # ranges checked by the decoder
        else:
            state.update(items)

    def _kafka_producer(self):
        if self._producer is None:
            self._producer = service_producer(self.cfg)
        return self._producer

    def _caught_up(self, task: WindowTask) -> None:
        """The source had nothing more: a replay target not reached by now never will be (a
        partition with fewer records than its end offset showed, e.g. compaction)."""
        probe = getattr(self.source, "caught_up", None)
        if task.close_at is not None and (probe is None or probe(list(task.close_at))):
            task.close_at = None
            if task.window["kind"] == "time" and task.progress() >= 1:
                self._close(task)

    def _close(self, task: WindowTask) -> None:
        self.close_window()

    def _maybe_close_time_window(self, task: WindowTask) -> None:
        if task.window["kind"] != "time" or task.close_at is not None:
            return  # replaying: the window closes when the replay reaches its target
        progress = task.progress()
        self.metrics.window_progress.set(min(progress, 1.0))
        if progress >= 1:
            self._close(task)

    def _maybe_snapshot(self, task: WindowTask) -> None:
        """Optional layered snapshots at public points of the window (each costs two layers in
        the release; they bound the replay after a crash to a fraction of the window)."""
        k = self.snapshots_per_window
        if not k or task.close_at is not None or task.window["snapshots"] >= k:
            return
        if task.inflight:  # a snapshot checkpoint lists no closed windows: it waits for them
            return
        if task.progress() >= (task.window["snapshots"] + 1) / (k + 1):
            task.window["snapshots"] += 1
            self.commit(task, snapshot=True, tag=(task.window["snapshots"],))

    # -- the checkpoint ------------------------------------------------------------------------
    def commit(self, task: WindowTask, *, snapshot: bool = False, tag: tuple = ()) -> bytes | None:
        """Make ``task``'s position durable (the numbered sequence of the module docstring).
        With ``snapshot``, the checkpoint carries a layered snapshot of the counters, which is
        returned (an audit export reuses it)."""
        if not snapshot and task.window["events"] != (task.replay or {}).get("events", 0):
            # offsets past counted events with no counters would lose them at the next crash
            # (events counted before the window started are replayed: task.replay)
            raise RuntimeError("a checkpoint without a snapshot inside a window")
        # 1. every dead letter of a record before the new offsets is acknowledged
        self._wait_for(self._flush_dead_letters, "dead letters")
        # 2. a fresh layer, the snapshot, a fresh layer: the snapshot is a view of its own
        blob = None
        if snapshot:
            wid = task.window["id"]
            task.state.rerandomize(rng=self._rng(2, wid, *tag, 0))
            blob = task.state.serialize()
            task.state.rerandomize(rng=self._rng(2, wid, *tag, 1))
        # 3. the checkpoint, atomically, with the ledger's head (an older ledger is refused)
        record = task.record(blob)
        record.ledger_head = self.ledger.head()
        self._wait_for(lambda: self._save(task, record), "checkpoint")
        # 4. offsets to the Kafka group, for lag monitoring, with the ledger's head as anchor
        self.source.commit(record.offsets, self._kafka_anchor())
        return blob

    def _kafka_anchor(self) -> str:
        return kafka_metadata({self.anchor_name: self.ledger.head()})

    def _save(self, task: WindowTask, record) -> None:
        t0 = time.perf_counter()
        task.store.save(record)
        task.durable = record
        self.metrics.checkpointed(time.perf_counter() - t0)

    def _save_pending(self, task: WindowTask) -> None:
        """Publishing progress only: the last durable checkpoint with the shorter pending list."""
        if task.durable is None:
            self.commit(task)
            return
        record = task.rewrite_pending()
        record.ledger_head = self.ledger.head()
        self._wait_for(lambda: self._save(task, record), "checkpoint")

    def _flush_dead_letters(self) -> None:
        if self.dead_letters is not None:
            self.dead_letters.flush(timeout_s=10.0)

    def _wait_for(self, action, what: str) -> None:
        """Run ``action`` until it succeeds, with backoff and one log line per state change; a
        stop request ends the wait (:class:`Stopping`: the window is replayed next start)."""
        backoff = _Backoff(what)
        while True:
            try:
                action()
                if backoff.failing:
                    self.metrics.write_failing.labels(what=what).set(0)
                    self.metrics.set_ready(True)
                backoff.ok()
                return
            except (DeadLetterError, OSError) as exc:
                if isinstance(exc, OSError) and exc.filename is None:
                    exc.filename = str(self.dir)
                reason = (str(exc) if isinstance(exc, DeadLetterError) else
                          f"{exc.strerror or type(exc).__name__}: {exc.filename}")
                backoff.failed(reason)
                # intake waits for this write: health checks must say so at once
                self.metrics.write_failing.labels(what=what).set(1)
                self.metrics.set_ready(False, f"{what} cannot be written ({reason}); intake "
                                              "waits for it")
            while not backoff.ready():
                if self.stop_event.wait(0.1):
                    raise Stopping()

    # -- window close and release --------------------------------------------------------------
    def async_releases(self) -> bool:
        """Whether releases run beside the loop (``release.workers`` > 0) for this service:
        every window kind, with or without snapshots (several aggregations share one worker
        pool); scale-out releases in the loop (docs/configuration.md)."""
        return int(self.cfg.release.workers) > 0 and not self.user  # (user: one count of bits)

    def close_window(self) -> dict | None:
        """Release the current window (if the budget allows) and start the next one, durably.
        With a release worker, the release is computed beside the loop and collected later in
        window order (:meth:`_collect_releases`); the return value is then ``{"window": id}``."""
        self.metrics.intake_stall.set(self.intake_gap.take())
        if self.worker is not None and self.task.window_start is not None:
            return self._close_async(self.task)
        task = self.task
        t0 = time.perf_counter()
        closing = dict(task.window, ended_unix=time.time())
        wid, uid = closing["id"], closing["uid"]
        release = self._ledgered_release(task, closing)
        if release is not None:
            task.pending.append(json.dumps(release, allow_nan=False))
            if self.rollups is not None:
                self.rollups.fold(task.pending)
        if task.queue:  # after a restart: the next closed window to replay, or the open one
            self._open_next(task, closing)
            if not task.queue and task.close_at is None:
                self.commit(task)
            self._publish_pending(task)
            return release
        task.close_at = None
        task.window = self._new_window(task, wid + 1)
        # where the next window's records start (an event-time second window: where its
        # replay starts), and the chain of checkpoints it belongs to
        task.window.update(lineage=closing.get("lineage"), start_offsets=dict(
            (task.replay or {}).get("offsets") or task.offsets))
        task.mark_start()
        carried = self.event_time.carried_state()  # the second window, counting already
        task.state = carried if carried is not None else self._new_state(task, wid + 1)
        self.metrics.window_id.set(wid + 1)
        self.metrics.window_events.set(task.window["events"])
        self.metrics.window_progress.set(0)
        self.commit(task)  # the next window's start and the pending release, atomically
        self._publish_pending(task)
        self.metrics.release_duration.observe(time.perf_counter() - t0)
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
        log.debug("closed window %s (uid %s)", wid, uid)
        return release

    # -- releases beside the loop ---------------------------------------------------------------
    def _close_async(self, task: WindowTask) -> dict:
        """Close the window: ledger check over its source ranges (before any release noise),
        hand the closed state to the worker, start the next window at once."""
        closing = dict(task.window, ended_unix=time.time())
        wid, uid = closing["id"], closing["uid"]
        ranges, charge = self.window_ranges(task, closing), self.gate.charge_of(closing)
        entry = self.ledger.get(f"release-{uid}")
        start = task.window_start  # set whenever a window opens (mark_start)
        event_time = closing["kind"] == "event_time"
        # (event time: what the entry records of the second window, before the next opens)
        extra = self.event_time.second_window_fields() if event_time else {}
        job = None
        if entry is not None:  # decided before a restart (never replayed: kept for safety)
            if entry["document"] not in task.pending:
                task.pending.append(entry["document"])
        elif self.gate.allows(uid, wid, ranges=ranges, charge=charge, closing=closing,
                              in_flight=task.inflight, refusal_fields=lambda: self._position_fields(
                                  task, closing, ranges)):
            self._wait_for_room(task)
            future = self.worker.submit(
                task.state, model=self.model, loss=self.loss, window=wid, rng=self._rng(1, wid),
                error_bar_reps=int(self.cfg.release.error_bar_reps),
                method=release_method(self.cfg), keep_view=self.rollups is not None)
            job = {"window": closing, "start": start, "ranges": ranges, "charge": charge,
                   "end_offsets": dict(task.offsets), "totals": copy.deepcopy(task.totals),
                   "future": future, "extra": extra}
            task.inflight.append(job)
            failpoint("release-submitted")
        elif event_time and task.inflight:
            # refused: its entry is in the ledger; the checkpoint that passes it follows the
            # releases still in flight (rare: the budget is spent)
            self._collect_releases(task, wait=True)
        self._open_next(task, closing)
        self.metrics.release_queue.set(len(task.inflight))
        if event_time:
            # the checkpoint that starts the next window is written once this window's release
            # is ledgered (:meth:`_collect_releases`): until then a restart replays this window
            # from its start (a stop in between: the restart sees the entry and passes it)
            if job is not None:
                job["checkpoint"] = task.record(None)
            elif not task.inflight:
                self.commit(task)
        elif not task.queue and task.close_at is None:
            self.commit_position(task)
        log.debug("closed window %s (uid %s)", wid, uid)
        return {"window": wid}

    def _open_next(self, task: WindowTask, closing: dict) -> None:
        """The window after ``closing``: the next one a restart still has to replay, or a new
        one starting here."""
        wid = closing["id"]
        task.close_at = None
        task.state = None  # the closed counters now live in the worker only
        if task.queue:
            nxt = task.queue.pop(0)
            task.window = dict(nxt["window"], events=0)
            if nxt.get("end_offsets") is not None:
                task.close_at = {p: int(o) for p, o in nxt["end_offsets"].items()}
        else:
            task.window = self._new_window(task, wid + 1)
            # (event time: the second window's records start before this window's close)
            task.window.update(lineage=closing.get("lineage"), start_offsets=dict(
                (task.replay or {}).get("offsets") or task.offsets))
        task.mark_start()
        carried = self.event_time.carried_state()  # the second window, counting already
        task.state = carried if carried is not None else self._new_state(task, task.window["id"])
        if task.close_at is None:
            self._replay_target(task)  # a time window that ended while the service was down
        self.metrics.window_id.set(task.window["id"])
        self.metrics.window_events.set(0)
        self.metrics.window_progress.set(0)

    def _wait_for_room(self, task: WindowTask) -> None:
        """Backpressure: at ``release.max_in_flight`` closed windows waiting for their release,
        intake pauses (one line, ``panagg_intake_paused``) until the oldest is released."""
        limit = int(self.cfg.release.max_in_flight)
        if len(task.inflight) < limit:
            return
        log.warning("the release path is behind (%d closed windows waiting, "
                    "release.max_in_flight = %d): intake pauses until window %s is released",
                    len(task.inflight), limit, task.inflight[0]["window"]["id"])
        self.metrics.intake_paused.set(1)
        while len(task.inflight) >= limit:
            try:
                task.inflight[0]["future"].exception(timeout=0.5)
            except FuturesTimeout:  # meanwhile: true lag, health, a stop request
                self.metrics.heartbeat()
                self._update_lag(now=True)
                if self.stop_event.is_set():
                    raise Stopping() from None
                continue
            self._collect_releases(task, commit=False)
        self.metrics.intake_paused.set(0)

    def _collect_releases(self, task: WindowTask, *, wait: bool = False,
                          commit: bool = True) -> int:
        """Ledger, checkpoint and publish the worker's finished releases in window order (with
        ``wait``: every one in flight). Returns how many were collected."""
        done = 0
        committed = False  # event time: each window's next start is committed as it is ledgered
        while task.inflight and (wait or task.inflight[0]["future"].done()):
            job = task.inflight[0]
            try:
                release, started, ended, *view = job["future"].result()
            except Exception as exc:
                raise ServiceError(f"the release of window {job['window']['id']} failed in the "
                                   f"release worker ({type(exc).__name__}: {exc}); it is "
                                   "replayed and released at the next start") from None
            closing = job["window"]
            self._annotate(release, closing)
            if job["charge"] > 0:
                warn_if_below_noise(release)
            else:
                log.info("window %s had no events: released at epsilon 0 (it holds only noise)",
                         closing["id"])
            doc = json.dumps(release, allow_nan=False)
            self.ledger.append(entry_id=f"release-{closing['uid']}", kind="release",
                               window=closing["id"], window_uid=closing["uid"],
                               epsilon_spent=job["charge"], model=self.model, document=doc,
                               **self.gate.position_fields(closing, job["ranges"],
                                                           job["end_offsets"], job["totals"]),
                               **job.get("extra", {}))
            failpoint("release-ledgered")
            task.pending.append(doc)
            task.inflight.pop(0)
            if view:
                self.rollups.keep_view(closing, release, *view[0])
                self.rollups.fold(task.pending)
            if job.get("checkpoint") is not None:
                # event time: at once (its start was fixed at the close, whatever the loop does
                # now), so that at most one ledgered window is ahead of the checkpoint (a
                # restart passes that one: _skip_decided_event_window)
                self._commit_start(task, job["checkpoint"])
                committed = True
            self.release_runs.append((closing["id"], started, ended))
            self.metrics.release_duration.observe(ended - started)
            self.metrics.release_latency.observe(max(0.0, time.time() - closing["ended_unix"]))
            done += 1
        if done:
            self.metrics.release_queue.set(len(task.inflight))
            self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
            if committed:
                self._publish_pending(task)
            elif commit and not task.queue and task.close_at is None:
                self.commit_position(task)
                self._publish_pending(task)
        return done

    def _commit_start(self, task: WindowTask, record) -> None:
        """Event time: the checkpoint that starts the window after one whose release is now
        ledgered (as the close in the loop writes it), with the current pending releases."""
        record.pending = list(task.pending)
        self._save_position(task, record)
        future = self.event_time.future
        if future is not None:  # a restart starts here now: older decisions are moot
            future.prune(self.event_time.replay_starts(record))

    def commit_position(self, task: WindowTask) -> None:
        """A checkpoint while windows are in flight or the open window counts: the replay
        starts at the first unreleased window (or the open window's start), and the closed,
        unreleased windows are listed with their ends (the commit sequence of
        :meth:`commit` without a snapshot)."""
        self._save_position(task, task.record_position())

    def _save_position(self, task: WindowTask, record) -> None:
        """Steps 1, 3 and 4 of :meth:`commit` for a checkpoint without counters: the dead
        letters before it acknowledged, the record with the ledger's head, the group's offsets."""
        self._wait_for(self._flush_dead_letters, "dead letters")
        record.ledger_head = self.ledger.head()
        self._wait_for(lambda: self._save(task, record), "checkpoint")
        self.source.commit(record.offsets, self._kafka_anchor())

    def _annotate(self, release: dict, closing: dict) -> None:
        """What the service adds to a release document: the window, what was counted, which
        aggregation."""
        release["window_info"] = {k: closing[k] for k in
                                  ("kind", "size", "events", "started_unix", "ended_unix")}
        if closing["kind"] == "event_time":
            release["window_info"].update(
                {k: closing.get(k) for k in ("event_start_unix", "event_end_unix", "late")},
                late_policy=self.cfg.window.late,
                allowed_lateness_s=self.cfg.window.allowed_lateness_s)
        release["counted"] = {"stream": identity_of(self.cfg)["stream"],
                              "item": item_identity(self.cfg)}
        if self.aggregation:
            release["aggregation"] = dict(self.aggregation.to_dict(), epsilon=self.epsilon)
            level = release["aggregation"].pop("rollup_level", None)
            if level:
                release["rollup_level"] = level
        stamp_window(release)

    def _ledgered_release(self, task: WindowTask, closing: dict) -> dict | None:
        """The window's release: from the ledger if it is there, else computed once (after the
        budget check over its source ranges, before anything is durable) and ledgered with its
        document, its ranges and the totals at its end."""
        wid, uid = closing["id"], closing["uid"]
        entry = self.ledger.get(f"release-{uid}")
        if entry is not None:
            log.info("window %s is already in the ledger: re-publishing its ledgered release",
                     wid)
            return json.loads(entry["document"])
        ranges = self.window_ranges(task, closing)
        charge = self.gate.charge_of(closing)
        if not self.gate.allows(uid, wid, ranges=ranges, charge=charge, closing=closing,
                                refusal_fields=lambda: self._position_fields(task, closing,
                                                                             ranges)):
            return None
        view: list | None = [] if self.rollups is not None else None
        release = (user_release(task.state, self.cfg, window=wid, n=int(closing["events"]),
                                rng=self._rng(1, wid)) if self.user else
                   make_release(task.state, model=self.model, loss=self.loss, window=wid,
                                rng=self._rng(1, wid),
                                error_bar_reps=int(self.cfg.release.error_bar_reps),
                                method=release_method(self.cfg), view=view))
        if charge > 0:
            warn_if_below_noise(release)
        else:
            log.info("window %s had no events: released at epsilon 0 (it holds only noise)", wid)
        self._annotate(release, closing)
        doc = json.dumps(release, allow_nan=False)
        self.ledger.append(entry_id=f"release-{uid}", kind="release", window=wid,
                            window_uid=uid, epsilon_spent=charge, model=self.model,
                            document=doc, **self._position_fields(task, closing, ranges))
        if view:
            self.rollups.keep_view(closing, release, *view[0])
        return release

    def window_ranges(self, task: WindowTask, window: dict | None = None) -> dict:
        """The source positions the window covers (:func:`.release_gate.covered_ranges`): what
        its release charges in the ledger."""
        window = task.window if window is None else window
        return covered_ranges(window.get("start_offsets"), task.offsets)

    def _position_fields(self, task: WindowTask, closing: dict, ranges: dict) -> dict:
        """The gate's position fields at the task's current position (event time: and what
        the entry records of the second window)."""
        fields = self.gate.position_fields(closing, ranges, task.offsets, task.totals)
        if closing.get("kind") == "event_time":
            fields.update(self.event_time.second_window_fields())
        return fields

    def _publish_pending(self, task: WindowTask) -> None:
        """Deliver the ledgered releases of ``task.pending`` (:mod:`.publisher`): files at once,
        the release topic retried on its own; each leaves the checkpoint once every sink has
        it."""
        if not task.pending or not self.publisher.due():
            return
        done = self.publisher.publish(list(task.pending))
        for doc in done:
            failpoint("published")
            task.pending.remove(doc)
        if done:
            self._save_pending(task)
            self._anchor_in_release_dir()

    @staticmethod
    def _release_key(release: dict) -> str:
        key = str(release["window"])
        if release.get("aggregation"):
            key = f"{release['aggregation']['name']}/{key}"
        return key

    def _published(self, release: dict, path: Path) -> None:
        """A release's file is written: metrics and the log line."""
        self.metrics.releases.inc()
        self.metrics.last_release.set(time.time())
        self.metrics.published(release)
        log.info("published release of window %s: n=%s -> %s", release["window"], release["n"],
                 path)

    def _anchor_in_release_dir(self) -> None:
        """The ledger's head beside the published releases (:mod:`.anchor`); best effort: a
        failure is said once and retried at the next publication."""
        try:
            from state_store.registry import ledger_id
            write_release_dir_anchor(self.cfg.release.dir, self.ledger.path,
                                     self.ledger.head(), ledger_id(self.ledger.entries))
        except OSError as exc:
            log.warning("could not record the ledger's head in %s (%s); retried at the next "
                        "publication", self.cfg.release.dir, exc.strerror or exc)

    # -- announced audit exports and control requests ------------------------------------------
    def export(self, export_id: str | None = None) -> Path:
        """Signed snapshot for auditors, with fresh layers just before and just after it."""
        if self.user:
            raise ServiceError(NO_EXPORT)
        key = load_key(self.cfg.audit.key_file or None)
        if self.event_time.second is not None and self.event_time.second.events:
            raise ServiceError(
                f"an audit export while two event-time windows are live is not built (window "
                f"{self.task.window['id']} is open within window.allowed_lateness_s while the "
                "next one counts already); request it again once that window has closed")
        if self.task.inflight:  # the export's checkpoint holds no list of unreleased windows
            self._collect_releases(self.task, wait=True)
        self._export_seq += 1
        export_id = export_id or f"{int(time.time())}-{self.task.window['id']}-{self._export_seq}"
        return self._export_task(self.task, export_id, key)

    def _export_task(self, task: WindowTask, export_id: str, key: bytes) -> Path:
        """Export ``task``'s state: the layered snapshot of a checkpoint (so a restart resumes
        from it instead of drawing noise the export did not see), ledgered, then signed."""
        snapshot = self.commit(task, snapshot=True, tag=(1000 + self._export_seq,))
        self._ledger_append(entry_id=f"export-{export_id}", kind="export",
                            window=task.window["id"], window_uid=task.window["uid"],
                            epsilon_spent=0.0, model=self.model,
                            note="announced export; fresh DLap layers before and after")
        out_dir = Path(self.cfg.audit.dir or self.dir / "exports")
        path = write_export(out_dir / f"export-{export_id}.panagg", state=snapshot,
                            window=task.window, offsets=task.offsets, export_id=export_id, key=key)
        self.metrics.exports.inc()
        log.info("audit export %s written to %s", export_id, path)
        return path

    def _ledger_append(self, **entry) -> None:
        if self._deferred is not None:  # a start still checking: written once all checks pass
            self._deferred.append(entry)
            return
        self.ledger.append(**entry)

    def _start_append(self, **entry) -> None:
        """An entry of the start's checks (identity, fresh start): deferred while a start is
        checking, else written directly (scale-out holds the group's lock around its start)."""
        if self._deferred is not None:
            self._deferred.append(entry)
        else:
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
                    result = ({"ok": True, "window": rel["window"]} if rel is not None else
                              {"ok": False, "error": "the privacy ledger refused the release "
                               "(budget spent); see the service log"})
                else:
                    result = {"ok": False, "error": f"unknown request {kind}"}
            except Stopping:
                raise
            except AuditKeyError as exc:
                result = {"ok": False, "error": service_key_error(exc)}
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            # whole or not at all: the CLI reads the answer as soon as the file exists (a plain
            # write let it read an empty file: a JSONDecodeError trace, seen in the suite)
            atomic_write(done, [json.dumps(result).encode()])
            req.unlink(missing_ok=True)

    def _update_lag(self, now: bool = False) -> None:
        """Lag and broker state every 5 s (``now``: at once, from the broker's end offsets, for
        a loop that is not polling)."""
        if now:
            probe = getattr(self.source, "lag_now", None)
            lag = probe(self._positions()) if probe else None
            for part, value in (lag or {}).items():
                if self._reports_lag_of(part):
                    self.metrics.lag.labels(partition=part).set(value)
            return
        now_t = time.monotonic()
        if now_t - self._last_lag < 5.0:
            return
        self._last_lag = now_t
        probe = getattr(self.source, "connected", None)
        state = probe() if probe else None
        if state is not None:
            if self._connected is not None and state != self._connected:
                log.warning("Kafka broker %s", "reachable again" if state else
                            "unreachable: counting waits; time windows still close by the clock")
            self._connected = state
            self.metrics.broker_connected.set(int(state))
        lag = self.source.lag(self._positions())
        for part, value in (lag or {}).items():
            if self._reports_lag_of(part):
                self.metrics.lag.labels(partition=part).set(value)

    def _reports_lag_of(self, partition: str) -> bool:
        return True

    def _positions(self) -> dict[str, int]:
        return dict(self.task.offsets)

    def budget_exhausted(self) -> str | None:
        """The line to pause intake with, when ``ledger.budget_total`` leaves less than one
        window's epsilon: counting on would only fill windows that are refused and discarded."""
        remaining = self.ledger.remaining()
        if remaining is None or remaining >= self.epsilon * (1 - 1e-12):
            return None
        return (f"privacy budget spent: {self.ledger.spent():g} of ledger.budget_total="
                f"{self.ledger.budget_total:g} leaves {remaining:g} < {self.epsilon:g} for a "
                "window, so intake is paused (nothing is consumed, no window is counted only to "
                "be discarded). Fix: raise ledger.budget_total (a policy change, recorded in the "
                "ledger with --accept-change) or stop the service")

    def _paused_for_budget(self, poll_timeout_s: float, finite: bool) -> bool:
        """True while intake is paused (the loop then only serves control requests).

        Only an endless source (Kafka) pauses: a finite run (a file, the generator) goes to its
        end, and each window the budget cannot pay for is refused, ledgered and logged."""
        if finite:
            return False
        problem = self.budget_exhausted()
        self.metrics.intake_paused.set(1 if problem else 0)
        if problem is None:
            self._pause_logged = None
            return False
        now = time.monotonic()
        if self._pause_logged is None or now - self._pause_logged >= 600.0:
            log.error("%s", problem)  # once, then every 10 minutes while paused
            self._pause_logged = now
        self.metrics.heartbeat()
        self.metrics.set_ready(False, "privacy budget spent: intake paused")
        self._handle_control()
        self.stop_event.wait(poll_timeout_s)
        return True

    PROGRESS_EVERY_S = 60.0

    def _progress_line(self) -> None:
        """One info line a minute: events counted, rate, open window(s), lag (public numbers)."""
        now = time.monotonic()
        last = self._progress_at
        if last is None:
            self._progress_at, self._progress_events = now, self.metrics.events._value.get()
            return
        if now - last < self.PROGRESS_EVERY_S:
            return
        events = self.metrics.events._value.get()
        rate = (events - self._progress_events) / (now - last)
        self._progress_at, self._progress_events = now, events
        lag = sum(s.value for m in self.metrics.lag.collect() for s in m.samples)
        log.info("progress: %s events counted (%.0f/s over the last %.0f s), window %s at %s "
                 "events, lag %s records", f"{int(events):,}", rate, now - last,
                 int(self.metrics.window_id._value.get()),
                 f"{int(self.metrics.window_events._value.get()):,}", f"{int(lag):,}")

    def _turned(self) -> None:
        """One turn of the consume loop is done: /healthz and /ready (docs/operations.md)."""
        self.metrics.heartbeat()
        self._progress_line()
        self.reject_log.flush()
        if self._connected is False:
            self.metrics.set_ready(False, "Kafka broker unreachable")
        elif self.dead_letters is not None and self.dead_letters.outstanding > 10_000:
            self.metrics.set_ready(False, "dead letters are not being acknowledged")
        else:
            self.metrics.set_ready(True)

    def _check_state_matches_config(self, state: PanPrivateHistogram, where: str,
                                    size: int | None = None) -> None:
        """Refuse a restored state built with other settings (``size``: the expected number of
        counters, default the configured D or B)."""
        if state.neighbor != "replace-one":
            raise ServiceError(f"{where} holds an {state.neighbor} state; the service counts "
                               "under replace-one neighbours only (its offsets, metrics and count "
                               "windows reveal n)")
        mode = "direct" if self.direct else "hashed"
        size = self.size if size is None else size
        if (state.mode, state.size, state.epsilon) != (mode, size, self.epsilon):
            raise ServiceError(
                f"{where} holds a {state.mode} state of size {state.size} at epsilon "
                f"{state.epsilon}, but the config asks for {mode}, size {size}, epsilon "
                f"{self.epsilon}; use the original settings or a new checkpoint.dir")


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
