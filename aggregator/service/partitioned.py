"""Scale-out: one pan-private state per Kafka partition, merged into one release per window.

Kafka is the distributed engine. N aggregator processes join one consumer group over a topic keyed
by the counted item; each owns the states of the partitions the group assigns it. Everything they
share lives in one directory (``checkpoint.dir``; a local disk for processes on one host, a
network filesystem with working ``flock`` for several hosts)::

    partitions/<topic>-<p>/       one checkpoint store per partition + owner.lock (flock)
    windows/<w>/summary-<p>.json  partition p's summary of window w (written once, atomically)
    windows/<w>/release.json      the merged release document (written once, then published)
    windows/<w>/published         marker: the release is out
    merge.lock, ledger.jsonl      one merge at a time; the shared privacy ledger

Each partition is a :class:`~aggregator.service.window.WindowTask` run by the same code as the
single-process service (:class:`~aggregator.service.process.Aggregator`): its open window's
counters live only in memory, its checkpoint holds the window's start offset, totals and
unpublished summaries (plus optional layered snapshots), and a new owner rebuilds the window by
replaying the partition from that offset under fresh noise. A handover is a view like any other:
nothing of the old owner's counters is written for the new owner to read.

Ownership. A process counts a partition only while it holds that partition's ``owner.lock``; it
loads the partition's checkpoint after taking the lock and seeks the consumer to the offset inside
it. When the group moves the partition away, the process drops its state and the lock; the new
owner replays. A killed process loses its locks with its life. So a rebalance, a crash or a zombie
member neither loses nor double-counts an event.

Windows are per partition. Count windows close after ``window.size`` events *of that partition*;
time windows are aligned to the epoch (window w covers [w * size, (w + 1) * size) in Unix time).
The set of windows a partition must summarize is a function of its checkpoint and the clock, not
of what other members wrote: a partition first taken (no checkpoint) summarizes, with noise only,
every window since the group's first window (recorded in the ledger's identity) that the ledger
has not released yet; a partition that had no owner for a while fills its skipped windows the same
way when it closes the next one.

The ledger before the noise. Closing window w of partition p first asks the shared ledger (under
``merge.lock``): the first partition to close window w reserves its release (the budget check and
the epsilon spent); if the budget refuses it, the ledger records the refusal and *no* partition
draws a release layer or writes a summary for that window, so nothing of a refused window can be
rebuilt. Then the release layer is added (joint model), the noisy-value counts c_v are taken and
written as ``summary-<p>.json`` (first made durable in the partition's checkpoint, so a crash
re-writes the same summary rather than drawing a second release layer). c_v is additive over
states: :func:`merge_summaries` (deterministic) computes the window's release from the P
summaries; the document is ledgered, then published. A window whose document is in the ledger is
re-published from it, never merged again.

* Hashed mode: each partition keeps B / P buckets, disjoint from the others' (an item lives in its
  key's partition), so the P arrays together are one B-bucket hashed state.
* Direct mode: each partition keeps all D counters; the merge removes the expected value counts of
  the (P - 1) * D counters a keyed topic leaves empty (:func:`remove_empty_counters`).

Topics not keyed by item. If one item's events reach several partitions, each partition counts a
piece of it. Records are not checked for it: whether a record's key is its item is a function of
the event, and any count of such records (a metric, a log line, a release field) would be an
un-noised, data-dependent number an intruder or an operator can read (issue "One event, one
charge", docs/privacy.md section 15). The start line says so; producers must key records by the
counted item (docs/scale-out.md).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from consumers.base import Segment, offsets_array
from state_store.audit import AuditKeyError, load_key
from state_store.local import LocalStore, atomic_write

from ..estimate import NoisyValueCounts, noise_pmf, noisy_value_counts
from ..noise import discrete_laplace
from ..release import (ERROR_BAR_REPS, STATE_ONLY_CAVEAT, estimate_with_accuracy,
                       package_release)
from ..state import PanPrivateHistogram
from .process import (Aggregator, ServiceError, Stopping, identity_of, item_identity,
                      release_method, service_key_error, warn_if_below_noise)
from .window import WindowTask, new_window

__all__ = ["PartitionedAggregator", "PartitionTask", "merge_summaries", "partition_summary",
           "item_key_bytes", "remove_empty_counters"]

log = logging.getLogger("panagg.scaleout")

SUMMARY_FORMAT = "panagg.summary"


# -- pure parts: summary and merge -------------------------------------------------------------------
def partition_summary(state: PanPrivateHistogram, *, model: str, window: int, partition: int,
                      partitions: int, window_info: dict, rng=None) -> dict:
    """The summary of one partition's window: noisy-value counts of its counters.

    Model ``"joint"`` adds the release layer W first (a fresh DLap(p) draw per counter; ``rng`` is
    a test-only source), so the summary is exactly what a one-state release would be computed
    from. The summary is post-processing of that view: it carries no more than the release.
    """
    counts, layers = state.counts, state.layers
    if model == "joint":
        counts = counts + discrete_laplace(state.p, state.size, rng=rng)
        layers += 1
    vc = noisy_value_counts(counts)
    nz = np.flatnonzero(vc.c)
    return {
        "format": SUMMARY_FORMAT, "version": 1, "window": int(window),
        "partition": int(partition), "partitions": int(partitions),
        "mode": state.mode, "size": int(state.size), "epsilon": state.epsilon,
        "neighbor": state.neighbor, "p": state.p, "layers": int(layers), "model": model,
        "n": int(state.n), "window_info": dict(window_info),
        "values": [[int(vc.lo + i), int(vc.c[i])] for i in nz],
    }


def _value_counts(summary: dict) -> NoisyValueCounts:
    values = np.asarray(summary["values"], dtype=np.int64).reshape(-1, 2)
    lo, hi = int(values[:, 0].min()), int(values[:, 0].max())
    c = np.zeros(hi - lo + 1, dtype=np.int64)
    c[values[:, 0] - lo] = values[:, 1]
    return NoisyValueCounts(lo, c)


_MUST_AGREE = ("window", "partitions", "mode", "epsilon", "neighbor", "p", "layers", "model")


def merge_summaries(summaries: list[dict], *, loss: str = "l1",
                    error_bar_reps: int = ERROR_BAR_REPS, method: str | None = None) -> dict:
    """The window's release from the summaries of all its partitions (deterministic).

    Noisy-value counts add up over partitions; the estimators then run once on the sum, with
    ``buckets`` = the total number of hash buckets in hashed mode.
    """
    if not summaries:
        raise ValueError("no summaries to merge")
    first = summaries[0]
    for s in summaries:
        if s.get("format") != SUMMARY_FORMAT:
            raise ValueError("not a partition summary")
        bad = [k for k in _MUST_AGREE if s[k] != first[k]]
        if bad:
            raise ValueError(f"summaries of window {first['window']} disagree on {', '.join(bad)}")
    have = sorted(s["partition"] for s in summaries)
    if have != list(range(first["partitions"])):
        raise ValueError(f"window {first['window']} needs summaries of partitions "
                         f"0..{first['partitions'] - 1}, got {have}")
    started = time.perf_counter()
    vc = _value_counts(summaries[0])
    for s in summaries[1:]:
        vc = vc.merge(_value_counts(s))
    counters = int(sum(s["size"] for s in summaries))
    if vc.total != counters:
        raise ValueError("summary value counts do not add up to the partitions' counters")
    n = int(sum(s["n"] for s in summaries))
    hashed = first["mode"] == "hashed"
    # split: each partition counted only its slice of the domain (scale.store = kafka), so the
    # slices together are one state of ``counters`` counters, exactly as one process has it
    split = bool(first.get("split"))
    if any(bool(s.get("split")) != split for s in summaries):
        raise ValueError(f"summaries of window {first['window']} mix domain slices and copies")
    empty = 0
    if not hashed and not split and first["partitions"] > 1:
        # keyed topic: an item is counted in one partition only, so at least (P - 1) * D of the
        # P * D counters hold nothing but noise; remove their expected share of the value counts
        empty = counters - int(first["size"])
        vc = remove_empty_counters(vc, empty, first["p"], first["layers"])
    hist, accuracy = estimate_with_accuracy(vc, first["p"], layers=first["layers"], loss=loss,
                                            n=n, buckets=counters if hashed else None,
                                            reps=error_bar_reps, method=method)
    infos = [s["window_info"] for s in summaries]
    release = package_release(
        hist, window=first["window"], n=n, epsilon=first["epsilon"], neighbor=first["neighbor"],
        model=first["model"],
        extra={"p": first["p"], "layers": first["layers"], "loss": loss,
               "domain": {"mode": first["mode"],
                          "size": counters if hashed or split else first["size"],
                          "counters": counters, "partitions": first["partitions"],
                          "empty_counters_removed": empty}},
        accuracy=accuracy)
    release["window_info"] = {
        "kind": infos[0]["kind"], "size": infos[0]["size"],
        "events": int(sum(i["events"] for i in infos)),
        "started_unix": min(i["started_unix"] for i in infos),
        "ended_unix": max(i["ended_unix"] for i in infos),
        "per_partition": "count windows close per partition" if infos[0]["kind"] == "count"
        else "time windows aligned to the epoch",
    }
    release["release_seconds"] = time.perf_counter() - started
    if first["model"] == "state-only":
        release["caveat"] = STATE_ONLY_CAVEAT
    return release


def remove_empty_counters(vc: NoisyValueCounts, empty: int, p: float,
                          layers: int) -> NoisyValueCounts:
    """Value counts minus the expected value counts of ``empty`` counters known to hold only
    noise (rounded, clipped at 0).

    Direct mode over P partitions: each partition keeps all D counters, but with a topic keyed by
    item each item is counted in one partition only, so at least (P - 1) * D counters are pure
    noise. Their values follow the known noise pmf q (``layers`` DLap(p) draws), so c_v minus
    (P - 1) * D * q(v) estimates the value counts of D counters, one per item, as one process
    would have them. Without it the estimators see P times the empty counters: the early-stopped
    deconvolution (joint model) then lost up to 10x in l1 at P = 6 (docs/scaleout_load.md).
    Post-processing of the summaries: no privacy cost.
    """
    K, q = noise_pmf(p, layers)
    lo, hi = min(vc.lo, -K), max(vc.hi, K)
    c = np.zeros(hi - lo + 1)
    c[vc.lo - lo: vc.lo - lo + len(vc.c)] += vc.c
    c[-K - lo: K - lo + 1] -= empty * q
    return NoisyValueCounts(lo, np.maximum(np.rint(c), 0).astype(np.int64))


def item_key_bytes(item) -> bytes:
    """The record key a topic keyed by item carries: UTF-8 for str, ints in decimal."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    return str(int(item)).encode()


class _FileLock:
    """An exclusive, non-blocking flock on ``path`` (released when the process dies)."""

    def __init__(self, path: Path):
        self.path, self.f = path, None

    def acquire(self, blocking: bool = False) -> bool:
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            f.close()
            return False
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self.f = f
        return True

    def release(self) -> None:
        if self.f is not None:
            self.f.close()  # closing drops the flock
            self.f = None


def partition_dir(key: str) -> str:
    """Directory name of partition ``"<topic>:<p>"`` under ``checkpoint.dir/partitions``."""
    topic, _, index = key.rpartition(":")
    return f"{topic}-{index}"


def partitions_held(checkpoint_dir) -> set[str]:
    """Partition directories (``<topic>-<p>``) whose lock a running member holds right now."""
    held = set()
    for lock in sorted(Path(checkpoint_dir).glob("partitions/*/owner.lock")):
        probe = _FileLock(lock)
        if probe.acquire():
            probe.release()
        else:
            held.add(lock.parent.name)
    return held


class PartitionTask(WindowTask):
    """One Kafka partition's :class:`WindowTask`, with its owner lock and directory."""

    def __init__(self, key: str, index: int, directory: Path):
        super().__init__(key)
        self.key, self.index = key, index
        directory.mkdir(parents=True, exist_ok=True)
        self.dir = directory
        self.lock = _FileLock(directory / "owner.lock")


class PartitionedAggregator(Aggregator):
    """An aggregator process in a consumer group of several (``scale.partitioned = true``).

    Same configuration, metrics and ledger as :class:`Aggregator`; the state is kept per
    assigned partition (:class:`PartitionTask`) and releases are merged across processes through
    the shared ``checkpoint.dir`` (see the module docstring).
    """

    def __init__(self, cfg: dict, source, metrics=None, **kwargs):
        super().__init__(cfg, source, metrics, **kwargs)
        if not hasattr(source, "owned"):
            raise ServiceError("scale.partitioned needs a Kafka source")
        self.tasks: dict[str, PartitionTask] = {}
        self.waiting: set[str] = set()      # assigned, lock held by another process
        self.generation_seen = -1
        self.parts_dir = self.dir / "partitions"
        self.windows_dir = self.dir / "windows"
        self.control.mkdir(parents=True, exist_ok=True)  # the shared directory of the group
        self.parts_dir.mkdir(exist_ok=True)
        self.windows_dir.mkdir(exist_ok=True)
        self.merge_lock = _FileLock(self.dir / "merge.lock")
        self._last_scan = 0.0
        self.partitions_total: int | None = None
        self.member = (cfg["source"]["instance_id"] or f"pid{os.getpid()}").replace("/", "_")
        self._answered: set[str] = set()
        self.identity: dict = {}

    # -- noise and windows ---------------------------------------------------------------------
    def _new_state(self, task: PartitionTask, window_id: int) -> PanPrivateHistogram:
        if self.direct:
            kwargs = {"size": self.size}
        else:  # disjoint arrays: together the partitions hold the B buckets of one state
            kwargs = {"buckets": self._expected_size(task)}
            if self._seed is not None:  # test-only: reproducible hashing across runs
                kwargs["key"] = hashlib.sha256(f"{self._seed}:{task.index}".encode()).digest()[:16]
        return PanPrivateHistogram(self.epsilon, rng=self._rng(0, task.index, window_id), **kwargs)

    def _expected_size(self, task: PartitionTask) -> int:
        if self.direct:
            return self.size
        return max(1, math.ceil(self.size / self.partitions_total))

    def _ensure_identity(self) -> None:
        """The group's identity (run id, first window) before any window is touched; taken
        outside the merge lock (restore takes it, and flock does not nest)."""
        if not self.identity:
            self.restore()

    def _window_uid(self, window_id: int) -> str:
        """Windows are the group's: every partition's window w is one ledger window."""
        return f"{self.identity['run']}-{window_id}"

    def _new_window(self, task: PartitionTask | None, window_id: int | None = None) -> dict:
        kind, size = self.cfg["window"]["kind"], self.cfg["window"]["size"]
        if kind == "time":
            if window_id is None:
                window_id = int(time.time() // size)
            started = window_id * size
        else:
            window_id, started = window_id or 0, None
        return new_window(window_id, kind, size, started_unix=started,
                          uid=self._window_uid(window_id))

    def _same_unit(self, entry: dict) -> bool:
        # ledger windows are the group's and count windows advance per partition: another
        # partition's later release is normal, so the roll-back check is the single process's
        return False

    # -- lifecycle -----------------------------------------------------------------------------
    def restore(self) -> None:  # partitions are restored one by one as they are assigned
        self.merge_lock.acquire(blocking=True)  # one identity for the whole group
        try:
            self.ledger.reload()
            self.identity = self.check_identity()
        finally:
            self.merge_lock.release()
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        try:
            self.restore()
            self.save_effective_config()  # after the identity check: a refused start writes none
            self.log_accuracy_plan()
            if self.cfg["item"]["source"] != "key":
                log.info("scale-out counts each item in the partition its records are in: the "
                         "topic's records must be keyed by the counted item (%s); this is not "
                         "checked on the records, since any such check is a function of the "
                         "events (docs/scale-out.md)", item_identity(self.cfg))
            idle_since = None
            finite = self.cfg["source"]["kind"] != "kafka"
            while not self.stop_event.is_set():
                if self._paused_for_budget(poll_timeout_s, finite):
                    continue
                if self.step(poll_timeout_s):
                    idle_since = None
                    continue
                # only an --exit-when-idle run asks (the check may wait on the broker)
                if idle_exit_s is None or not self.idle_can_count():
                    continue
                idle_since = idle_since or time.monotonic()
                if idle_exit_s is not None and time.monotonic() - idle_since >= idle_exit_s:
                    break
            for task in list(self.tasks.values()):
                self._drop(task)
            self._merge_scan(force=True)
        except Stopping:
            log.info("stopped while waiting; open windows are replayed by their next owner")
        finally:
            self.close()

    def step(self, poll_timeout_s: float = 0.5) -> int:
        """One turn of the loop: poll, follow the assignment, count, close windows, publish,
        snapshot, merge. Returns the number of records polled."""
        self._ensure_identity()
        segments = self.source.poll(poll_timeout_s)
        self._sync_assignment()
        for seg in segments:
            self._ingest(seg)
        polled = {seg.partition for seg in segments}
        for task in list(self.tasks.values()):
            if task.key not in polled:
                self._caught_up(task)
            self._maybe_close_time_window(task)
            self._maybe_snapshot(task)
            if task.pending:
                self._publish_summaries(task)
        self._handle_control()
        self._merge_scan()
        self._update_lag()
        self._update_gauges()
        self._turned()
        return sum(len(seg) for seg in segments)

    def close(self) -> None:
        for task in self.tasks.values():
            task.lock.release()
        super().close()

    def _sync_assignment(self) -> None:
        """Follow the group's assignment: hand partitions over, take new ones when their lock
        is free, and re-seek everything after a rebalance."""
        owned = self.source.owned()
        for key in [k for k in self.tasks if k not in owned]:
            self._drop(self.tasks[key])
        self.waiting &= owned
        if self.partitions_total is None and owned:
            self.partitions_total = self.source.partition_count()
        reseek = self.source.generation != self.generation_seen
        self.generation_seen = self.source.generation
        for key in sorted(owned - set(self.tasks)):
            if self.partitions_total is None or not self._take(key):
                if key not in self.waiting:
                    self.waiting.add(key)
                    self.source.pause([key])
                continue
            if key in self.waiting:
                self.waiting.discard(key)
                self.source.resume([key])
        if reseek:
            for task in self.tasks.values():
                self.source.seek_partition(task.key, task.offsets[task.key])

    def _take(self, key: str) -> bool:
        index = int(key.rpartition(":")[2])
        task = PartitionTask(key, index, self.parts_dir / partition_dir(key))
        if not task.lock.acquire():
            return False
        try:
            task.store = LocalStore(task.dir)  # opened under the lock: opening cleans temp files
            self.restore_task(task, where=f"partition {key} ({task.dir})")
            self.check_replayable(task)
        except Exception:
            task.lock.release()
            raise
        self.tasks[key] = task
        self.source.seek_partition(key, task.offsets[key])
        self.metrics.handovers.labels(event="acquired").inc()
        log.info("took partition %s: window %s from offset %d (replayed under fresh noise)", key,
                 task.window["id"], task.offsets[key])
        if task.pending:
            self._publish_summaries(task)
        return True

    def _first_start(self, task: PartitionTask, where: str) -> None:
        if any(e["kind"] == "release-document" for e in self.ledger.entries) \
                and not self.fresh_start:
            raise ServiceError(
                f"no checkpoint for {where}, but the group's ledger in {self.dir} records "
                "released windows: the partition's checkpoint was lost or moved away. Restore "
                "it from a backup, or start with --fresh-start (its open window is then never "
                "released)")
        task.window = self._new_window(task)
        task.state = self._new_state(task, task.window["id"])
        task.offsets = {task.key: self.source.start_offset(task.key)}
        task.pending, task.durable = [], None
        task.totals = {"events": 0, "rejects": {}}
        if task.window["kind"] == "time":
            # every earlier window of the group waits for this partition's summary
            first = int(self.identity.get("first_window", task.window["id"]))
            docs = self._summaries(task, range(first, task.window["id"]), noise_only=True)
            task.pending = [json.dumps(d, allow_nan=False) for d in docs]

    def _drop(self, task: PartitionTask) -> None:
        """Hand a partition over: publish what is pending, then release its lock. The open
        window's counters are not written: the next owner replays them under fresh noise."""
        if task.pending:
            self._publish_summaries(task)
        del self.tasks[task.key]
        task.lock.release()
        try:  # the new owner reports this partition's lag from now on
            self.metrics.lag.remove(task.key)
        except KeyError:
            pass
        self.metrics.handovers.labels(event="released").inc()
        log.info("handed over partition %s (window %s from offset %d is replayed by the next "
                 "owner)", task.key, task.window["id"],
                 (task.durable.offsets if task.durable else task.offsets).get(task.key, -1))

    def _end_offsets(self, task: PartitionTask) -> dict[str, int] | None:
        ends = super()._end_offsets(task)
        return None if not ends or task.key not in ends else {task.key: ends[task.key]}

    # -- counting ------------------------------------------------------------------------------
    def _ingest(self, seg: Segment) -> None:
        task = self.tasks.get(seg.partition)
        if task is None or not len(seg):
            return  # not ours (any more): the owner counts it from its own offsets
        nxt = task.offsets[task.key]
        if seg.offsets[0] < nxt:  # fetched before a seek: already in the counters
            cut = int(np.searchsorted(offsets_array(seg.offsets), nxt))
            seg = Segment(seg.partition, seg.offsets[cut:], seg.values[cut:],
                          None if seg.keys is None else seg.keys[cut:],
                          None if seg.headers is None else seg.headers[cut:])
            if not len(seg):
                return
        items, good, rejected = self._decode(seg)
        self._count_segment(task, seg, items, good, rejected,
                            lambda: self._close_task_window(task))

    # -- windows -------------------------------------------------------------------------------
    def _close(self, task: PartitionTask) -> None:
        self._close_task_window(task)

    def _close_task_window(self, task: PartitionTask) -> None:
        """Summarize the partition's window (and any it skipped), start the next one with fresh
        noise, durably."""
        closing = dict(task.window, ended_unix=time.time())
        wid = closing["id"]
        nxt = wid + 1
        if closing["kind"] == "time":  # skipped windows (e.g. the partition had no owner)
            nxt = max(nxt, int(closing["ended_unix"] // closing["size"]))
        docs = self._summaries(task, [wid], closing=closing)
        docs += self._summaries(task, range(wid + 1, nxt), noise_only=True)
        task.pending.extend(json.dumps(d, allow_nan=False) for d in docs)
        task.close_at = None
        task.window = self._new_window(task, nxt)
        task.state = self._new_state(task, nxt)
        self.commit(task)  # the summaries and the new window, atomically
        self._publish_summaries(task)

    def _summaries(self, task: PartitionTask, window_ids, *, closing: dict | None = None,
                   noise_only: bool = False) -> list[dict]:
        """This partition's summaries of ``window_ids`` that the ledger allows (the release
        layer is drawn only after the ledger reserved the window's release)."""
        partitions = self.source.partition_count() or self.partitions_total
        size = self.cfg["window"]["size"]
        docs = []
        for w in window_ids:
            if not self._window_allowed(w):
                continue
            if noise_only:  # nobody counted this partition in that window
                info = {"kind": "time", "size": size, "events": 0, "started_unix": w * size,
                        "ended_unix": (w + 1) * size}
                state = self._new_state(task, w)
            else:
                info = {k: closing[k] for k in ("kind", "size", "events", "started_unix",
                                                "ended_unix")}
                state = task.state
            docs.append(partition_summary(state, model=self.model, window=w,
                                          partition=task.index, partitions=partitions,
                                          window_info=info, rng=self._rng(1, task.index, w)))
        return docs

    def _window_allowed(self, wid: int) -> bool:
        """Whether window ``wid`` may be released; the first partition to ask reserves it in the
        shared ledger (budget checked, epsilon spent) and a refusal is recorded for all."""
        uid = self._window_uid(wid)
        self.merge_lock.acquire(blocking=True)
        try:
            self.ledger.reload()
            if self.ledger.has(f"release-doc-{uid}"):
                return False  # released already: a late summary would be dropped anyway
            if self.ledger.has(f"release-{uid}"):
                return True
            if not self._budget_allows(uid, wid):
                return False
            self.ledger.append(entry_id=f"release-{uid}", kind="release", window=wid,
                               window_uid=uid, epsilon_spent=self.epsilon, model=self.model,
                               note="reserved before any partition drew its release layer")
            self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
            return True
        finally:
            self.merge_lock.release()

    def _publish_summaries(self, task: PartitionTask) -> None:
        windows = []
        # under the merge lock: a merge may be cleaning up old window directories meanwhile
        self.merge_lock.acquire(blocking=True)
        try:
            self.ledger.reload()
            for doc in list(task.pending):
                summary = json.loads(doc)
                wid = summary["window"]
                # a summary re-published after a handover or crash may belong to a window that
                # was merged (and cleaned up) since: nothing left to do for it
                if not self.ledger.has(f"release-doc-{self._window_uid(wid)}"):
                    wdir = self.windows_dir / str(wid)
                    wdir.mkdir(exist_ok=True)
                    atomic_write(wdir / f"summary-{summary['partition']}.json", [doc.encode()])
                    windows.append(wid)
                    self.metrics.summaries.inc()
                task.pending.remove(doc)
        finally:
            self.merge_lock.release()
        self._save_pending(task)
        for wid in windows:
            self._try_merge(wid)

    # -- merge ---------------------------------------------------------------------------------
    def _merge_scan(self, force: bool = False) -> None:
        self._ensure_identity()
        now = time.monotonic()
        if not force and now - self._last_scan < 1.0:
            return
        self._last_scan = now
        waiting = 0
        for wdir in self.windows_dir.iterdir():
            if wdir.name.isdigit() and not (wdir / "published").exists():
                if not self._try_merge(int(wdir.name)):
                    waiting += 1
        self.metrics.windows_waiting.set(waiting)

    def _try_merge(self, wid: int) -> bool:
        """Merge, ledger and publish window ``wid`` if all its summaries are in; True if done."""
        wdir = self.windows_dir / str(wid)
        if (wdir / "published").exists():
            return True
        self._ensure_identity()
        if not self.merge_lock.acquire():
            return False  # another process is merging; the next scan looks again
        try:
            return self._merge_locked(wid, wdir)
        finally:
            self.merge_lock.release()

    def _merge_locked(self, wid: int, wdir: Path) -> bool:
        if not wdir.is_dir():  # merged and cleaned up since the scan listed it
            return True
        if any((wdir / m).exists() for m in ("published", "unmergeable")):
            return True
        uid = self._window_uid(wid)
        self.ledger.reload()
        entry = self.ledger.get(f"release-doc-{uid}")
        if entry is not None:  # ledgered: publish that document, never merge again
            doc = entry["document"]
        else:
            summaries = [json.loads(p.read_text()) for p in sorted(wdir.glob("summary-*.json"))]
            if not summaries or len(summaries) < max(s["partitions"] for s in summaries):
                return False
            try:
                release = merge_summaries(
                    summaries, loss=self.loss,
                    error_bar_reps=int(self.cfg["release"]["error_bar_reps"]),
                    method=release_method(self.cfg))
                release["counted"] = {"stream": identity_of(self.cfg)["stream"],
                                      "item": item_identity(self.cfg)}
                warn_if_below_noise(release)
            except ValueError as exc:  # e.g. the partition count changed within the window
                log.error("window %s cannot be merged: %s; its summaries stay in %s", wid, exc,
                          wdir)
                self.metrics.releases_refused.inc()
                atomic_write(wdir / "unmergeable", [str(exc).encode()])
                return True
            doc = json.dumps(release, allow_nan=False)
            self.ledger.append(entry_id=f"release-doc-{uid}", kind="release-document",
                               window=wid, window_uid=uid, model=release["model"], document=doc)
        if not self.publisher.due() or not self.publisher.publish([doc]):
            return False  # retried with backoff; the document is in the ledger
        atomic_write(wdir / "published", [b""])
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
        self._cleanup(wid)
        return True

    def _published(self, release: dict, path: Path) -> None:
        self.metrics.releases.inc()
        self.metrics.last_release.set(time.time())
        self.metrics.published(release)
        self.metrics.release_latency.observe(max(0.0, time.time()
                                                 - release["window_info"]["ended_unix"]))
        log.info("published merged release of window %s (%d partitions): n=%s -> %s",
                 release["window"], release["domain"]["partitions"], release["n"], path)

    def _cleanup(self, newest: int) -> None:
        keep = int(self.cfg["scale"]["keep_windows"])
        for wdir in self.windows_dir.iterdir():
            if (wdir.name.isdigit() and int(wdir.name) <= newest - keep
                    and (wdir / "published").exists()):
                shutil.rmtree(wdir, ignore_errors=True)

    def _reports_lag_of(self, partition: str) -> bool:
        return partition in self.tasks  # the lag cache may still hold a partition handed over

    def _positions(self) -> dict[str, int]:
        return {k: t.offsets[k] for k, t in self.tasks.items() if k in t.offsets}

    # -- gauges and control --------------------------------------------------------------------
    def _update_gauges(self) -> None:
        self.metrics.partitions_owned.set(len(self.tasks))
        if self.tasks:
            self.metrics.window_id.set(min(t.window["id"] for t in self.tasks.values()))
            self.metrics.window_events.set(sum(t.window["events"] for t in self.tasks.values()))

    def _window_gauges(self, task: WindowTask) -> None:
        pass  # per process: _update_gauges sums over the owned partitions once per turn

    # -- announced audit exports: each member exports the partitions it owns ------------------
    def _ledger_append(self, **entry) -> None:
        self.merge_lock.acquire(blocking=True)  # one shared ledger for all members
        try:
            self.ledger.reload()
            self.ledger.append(**entry)
        finally:
            self.merge_lock.release()

    def export(self, export_id: str | None = None) -> dict[str, str]:
        """Signed exports of every partition this process owns (fresh layers before and after
        each), as {partition: path}. ``panagg audit export`` collects them from all members."""
        key = load_key(self.cfg["audit"]["key_file"] or None)
        self._export_seq += 1
        export_id = export_id or f"{int(time.time())}-{self._export_seq}"
        out = {}
        for task in sorted(self.tasks.values(), key=lambda t: t.index):
            out[task.key] = str(self._export_task(task, f"{export_id}-p{task.index}", key))
        return out

    def _handle_control(self) -> None:
        """Requests live in the shared control directory: every member answers an export for
        its own partitions (``<request>.<member>.done``); other requests are refused."""
        for req in sorted(self.control.glob("*.req")):
            kind, _, rid = req.stem.partition("-")
            done = self.control / f"{req.stem}.{self.member}.done"
            if req.stem in self._answered or done.exists():
                continue
            self._answered.add(req.stem)
            try:
                if kind == "export":
                    result = {"ok": True, "partitions": self.export(rid)}
                else:
                    result = {"ok": False, "error": f"{kind} is not available in partitioned "
                              "mode (windows close per partition on their schedule)"}
            except Stopping:
                raise
            except AuditKeyError as exc:
                result = {"ok": False, "error": service_key_error(exc)}
            except Exception as exc:
                result = {"ok": False, "error": str(exc)}
            atomic_write(done, [json.dumps(result).encode()])

    def close_window(self) -> dict | None:
        raise ServiceError("in partitioned mode windows close per partition on their schedule; "
                           "there is no forced release")
