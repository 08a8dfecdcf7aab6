"""Several aggregations of one stream, fed by one consumer in one pass.

A login topic answers several questions at once: how often each account, each IP and each
device shows up. Each ``[aggregations.NAME]`` of the config is its own pan-private state, window,
checkpoint, ledger and release (an :class:`~aggregator.service.process.Aggregator` over
``checkpoint.dir/NAME`` and ``release.dir/NAME``, with its own item choice, epsilon and
window); :class:`MultiAggregator` reads the topic once and hands every poll to all of them.

Exactly once per aggregation. Each aggregation keeps its own offsets in its own checkpoints, so
at a start they differ (each replays its own open window). Every aggregation reads through a
:class:`SourceView` that remembers the next offset it wants per partition and drops what it has
already had; the one consumer starts at the least of those offsets. When an aggregation holds a
partition (a replay that reached its target before the others, an event-time window waiting for
the other partitions), the consumer keeps reading it for the others; when the hold ends, the
consumer goes back to the least offset any view still wants and the others drop the records
they had (re-read from Kafka, never buffered without bound). The consumer pauses a partition
only while every view holds it, so no aggregation can stall another for good.

Composition: an event is in one window of each aggregation, so it spends the sum of their
per-window budgets; the config refuses a set whose sum exceeds ``ledger.budget_per_event``
(:func:`aggregator.service.config.aggregation_configs`), each aggregation's ledger records the
set (a ``composition`` entry) and each release says which aggregation it is (docs/privacy.md,
section 19).

Metrics: one exposition; every series carries an ``aggregation`` label.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import threading
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry

from consumers.base import Segment, Source, offsets_array
from state_store.atomic import atomic_write

from .anchor import kafka_metadata, parse_kafka_metadata
from .config import aggregation_configs
from .errors import ServiceError, Stopping
from .metrics import Metrics
from .process import Aggregator
from .release_worker import ReleaseWorker
from .settings import Config
from .stages.caught_up import IdleExit
from .stages.labelled import ByAggregation
from .stages.state_dir import claim_directory, remove_created

__all__ = ["MultiAggregator", "SourceView"]

log = logging.getLogger("panagg.service")

SET_FILE = "aggregations.json"

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("aggregation", default=None)


class _NameInLog(logging.Filter):
    """Prefixes the service's log lines with the aggregation they are about."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = _current.get()
        if name and not getattr(record, "_aggregation", None):
            record.msg = f"[{name}] {record.msg}"
            record._aggregation = name
        return True


@contextlib.contextmanager
def _about(name: str):
    token = _current.set(name)
    try:
        yield
    finally:
        _current.reset(token)


def _slice(seg: Segment, start: int, stop: int | None = None) -> Segment:
    """The records of ``seg`` from index ``start`` to ``stop``."""

    def cut(col):
        return None if col is None else col[start:stop]

    return Segment(
        seg.partition,
        seg.offsets[start:stop],
        seg.values[start:stop],
        cut(seg.keys),
        cut(seg.headers),
        cut(seg.timestamps),
    )


#: records handed to every aggregation before the next ones (the shared parses' lifetime)
PARSE_CHUNK = 1024


def _chunks(segments: list[Segment], size: int):
    """The poll's segments cut into lists of at most ``size`` records, in order."""
    for seg in segments:
        n = len(seg)
        if n <= size:
            yield [seg]
            continue
        for start in range(0, n, size):
            yield [_slice(seg, start, start + size)]


class SourceView(Source):
    """What one aggregation sees of the shared consumer (the :class:`Source` methods the
    :class:`Aggregator` calls; the rest go to the shared source).

    ``next`` holds the next offset this view wants per partition: records below it were
    delivered already (or precede its checkpoint) and are dropped."""

    def __init__(self, hub: MultiAggregator, name: str):
        self.hub, self.name = hub, name
        self.next: dict[str, int] = {}
        self.held: set[str] = set()
        self.committed: dict[str, int] = {}

    # -- what the hub calls ----------------------------------------------------------------------
    def deliver(self, segments: list[Segment], origins: dict[str, int | None]) -> list[Segment]:
        """The records of ``segments`` this view has not had. ``origins[p]``: the consumer's
        position in partition ``p`` before the segment (where its stream of records continues
        from), or None where that is not known.

        A segment is taken only if it reaches back to the next offset this view wants: its
        first record is at or before it, or the consumer's stream runs unbroken from at or
        before it (offsets in between are transaction markers or compacted away). A segment
        that starts past it (records read for the others while this view held the partition)
        is left for the re-read the hub's seek brings: taking it would skip the records in
        between (the silent loss of issue 46)."""
        out = []
        for seg in segments:
            p = seg.partition
            if p in self.held or not len(seg):
                continue
            want = self.next.get(p)
            if want is not None:
                offsets = offsets_array(seg.offsets)
                origin = origins.get(p)
                if int(offsets[0]) > want and (origin is None or origin > want):
                    if origin is not None:
                        continue  # wait for the re-read from the hub's seek
                    # nothing says where the consumer came from: take it, but say so
                    log.error(
                        "partition %s: records %d-%d were skipped by the consumer "
                        "(retention or an offset reset?); the window's range names them",
                        p,
                        want,
                        int(offsets[0]) - 1,
                    )
                start = int(np.searchsorted(offsets, want))
                if start >= len(offsets):
                    continue
                if start:
                    seg = _slice(seg, start)
            self.next[p] = int(seg.offsets[-1]) + 1
            out.append(seg)
        return out

    # -- the Source interface the Aggregator uses ----------------------------------------------
    @property
    def exhausted(self) -> bool:  # type: ignore[override]
        return self.hub.source.exhausted

    def seek(self, offsets: dict[str, int]) -> None:
        self.next.update({p: int(o) for p, o in offsets.items()})

    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        # offline commands drive an aggregation alone; in the service the hub polls for all
        raise RuntimeError("a SourceView is fed by MultiAggregator, not polled")

    def commit(self, offsets: dict[str, int], metadata: str = "") -> None:
        self.committed = dict(offsets)
        self.anchor = parse_kafka_metadata(metadata).get(self.name)
        self.hub.commit_least()

    def committed_metadata(self) -> list[str]:
        probe = getattr(self.hub.source, "committed_metadata", None)
        return probe() if probe is not None else []

    def pause(self, keys) -> None:
        self.held.update(keys)
        self.hub.held_changed(keys)

    def resume(self, keys) -> None:
        self.held.difference_update(keys)
        self.hub.held_changed(keys, resumed=True)

    def committed_offsets(self) -> dict[str, int]:
        # the group's offsets belong to the set: a lost directory shows only if no aggregation
        # has started before (a newly added one starts at the group's offsets)
        if self.hub.set_started:
            return {}
        probe = getattr(self.hub.source, "committed_offsets", None)
        return probe() if probe is not None else {}

    def lag(self, positions=None):
        return self.hub.source.lag(positions)

    def lag_now(self, positions=None):
        probe = getattr(self.hub.source, "lag_now", None)
        return probe(positions) if probe is not None else self.hub.source.lag(positions)

    def close(self) -> None:
        pass  # the hub closes the shared source once

    def rebuild(self) -> None:
        self.hub.rebuild_source()

    def _seek_partition(self, key: str, offset: int) -> None:
        self.next[key] = int(offset)

    def __getattr__(self, name):
        if name == "seek_partition":  # only where the shared source can hold partitions
            if getattr(self.hub.source, "seek_partition", None) is None:
                raise AttributeError(name)
            return self._seek_partition
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.hub.source, name)


class MultiAggregator:
    """Every ``[aggregations.NAME]`` of ``cfg`` over one :class:`Source` (module docstring).

    Parameters as for :class:`~aggregator.service.process.Aggregator`; ``metrics`` serves the
    exposition of all aggregations (each has its own registry, labelled by name)."""

    def __init__(
        self,
        cfg: Config,
        source: Source,
        metrics: Metrics | None = None,
        *,
        fresh_start: bool = False,
        accept_change: bool = False,
        same_records_as: str | None = None,
    ):
        self.cfg, self.source = cfg, source
        self.dir = Path(cfg.checkpoint.dir)
        self.accept_change = accept_change
        configs = aggregation_configs(cfg)
        if not configs:
            raise ServiceError(
                "no [aggregations] in the config; panagg run counts one aggregation without them"
            )
        self.set_started = any((self.dir / name / "ledger.jsonl").exists() for name, _ in configs)
        self.stop_event = threading.Event()
        self.views: dict[str, SourceView] = {}
        self.aggs: dict[str, Aggregator] = {}
        for name, one in configs:
            self.views[name] = SourceView(self, name)
            agg = Aggregator(
                one,
                self.views[name],
                Metrics(),
                fresh_start=fresh_start,
                accept_change=accept_change,
                same_records_as=same_records_as,
            )
            agg.stop_event = self.stop_event  # one SIGTERM stops all
            self.aggs[name] = agg
        self.metrics = metrics or Metrics()
        # the exposition is the aggregations' series, labelled; not the hub's own (unused) ones
        self.metrics.registry = CollectorRegistry()
        self.metrics.registry.register(
            ByAggregation({name: agg.metrics.registry for name, agg in self.aggs.items()})
        )
        # one parse of each record for all aggregations (their decoders read, never change it)
        self._parsed: dict = {}
        for agg in self.aggs.values():
            agg.decoder.shared = self._parsed
        self._start: dict[str, int] = {}
        #: the consumer's next offset per partition as far as the hub knows (its seeks and the
        #: records it handed on); partitions seeked during the current poll
        self._position: dict[str, int] = {}
        self._seeked: set[str] = set()
        self._lock_file = None
        self._paused: set[str] = set()
        self.on_started = None  # called once every aggregation started (the CLI's metrics URL)

    # -- one consumer for all --------------------------------------------------------------------
    def _least(self, offsets_of) -> dict[str, int]:
        """Per partition every view has an offset for, the least of ``offsets_of(view)``. A
        partition some view has none for is left out: the consumer then starts it at the
        group's committed offset, or the earliest record when there is none; the group's offset
        is never past any view's (:meth:`commit_least`), so no view misses a record."""
        maps = [offsets_of(v) for v in self.views.values()]
        keys = set.intersection(*(set(m) for m in maps)) if maps else set()
        return {p: min(m[p] for m in maps) for p in keys}

    def commit_least(self) -> None:
        """Group offsets (lag monitoring only): the least any aggregation has checkpointed."""
        least = self._least(lambda v: v.committed)
        if least:  # with every aggregation's ledger head (aggregator.service.anchor)
            heads = {name: v.anchor for name, v in self.views.items() if getattr(v, "anchor", None)}
            self.source.commit(least, kafka_metadata(heads) if heads else "")

    def held_changed(self, keys, resumed: bool = False) -> None:
        if getattr(self.source, "seek_partition", None) is None:
            return
        for p in keys:
            want = [v.next[p] for v in self.views.values() if p in v.next]
            if resumed:  # back to the least offset a view still wants; the others drop repeats
                if want:
                    self._seek(p, min(want))
                if p in self._paused:
                    self.source.resume([p])
                    self._paused.discard(p)
            elif all(p in v.held for v in self.views.values()) and p not in self._paused:
                self.source.pause([p])
                self._paused.add(p)
                if want:
                    self._seek(p, min(want))

    def _seek(self, partition: str, offset: int) -> None:
        """Move the consumer in ``partition`` to ``offset``. The rest of the poll being counted
        is then stale for that partition (read before the seek): it is dropped, and read again."""
        self.source.seek_partition(partition, offset)
        self._position[partition] = int(offset)
        self._seeked.add(partition)

    def rebuild_source(self) -> None:
        """Replace the shared consumer after an intake stall (:meth:`.LoopHealth.watch_intake`
        of the aggregation that saw it first): the new one starts every partition at the least
        offset a view wants (:attr:`_start`), so that is where the consumer's stream now runs
        from."""
        self.source.rebuild()
        self._position.clear()
        self._position.update(self._start)

    def _track_start(self) -> None:
        # a (re)assignment seeks the consumer to these: the least offset any view wants
        self._start.clear()
        self._start.update(self._least(lambda v: v.next))

    # -- lifecycle ---------------------------------------------------------------------------------
    def _lock(self) -> None:
        # what this start creates, removed again if the start is refused (it writes nothing)
        self._created, self._lock_file = claim_directory(self.dir)

    def check_set(self) -> None:
        """The set of aggregations this directory counts; another set is refused unless
        --accept-change (each aggregation's own settings are checked by its own ledger)."""
        if (self.dir / "ledger.jsonl").exists():
            # a directory of one aggregation: its releases' charges are in that ledger, which
            # the aggregations below it would not see (their events would be released again)
            raise ServiceError(
                f"checkpoint.dir {self.dir} holds one aggregation's state (ledger.jsonl at its "
                "top); several aggregations (also window.rollup_design = tree or hybrid, which "
                "runs one per level) need a new checkpoint.dir, or keep "
                "window.rollup_design = sum"
            )
        path = self.dir / SET_FILE
        mine = {
            "aggregations": sorted(self.aggs),
            "budget_per_event": self.cfg.ledger.budget_per_event or None,
        }
        if path.exists():
            recorded = json.loads(path.read_text())
            if recorded == mine:
                return
            if not self.accept_change:
                raise ServiceError(
                    f"checkpoint.dir {self.dir} counts the aggregations "
                    f"{', '.join(recorded['aggregations'])} (budget per event "
                    f"{recorded['budget_per_event']}); this config has "
                    f"{', '.join(mine['aggregations'])} ({mine['budget_per_event']}). Use the "
                    "original set, a new checkpoint.dir, or --accept-change (a new aggregation "
                    "starts at the group's committed offsets, or a file's start; removed ones "
                    "keep their directories)"
                )
            log.warning(
                "the set of aggregations of %s changed: %s -> %s",
                self.dir,
                ", ".join(recorded["aggregations"]),
                ", ".join(mine["aggregations"]),
            )
        elif self.set_started and not self.accept_change:
            raise ServiceError(
                f"checkpoint.dir {self.dir} has aggregation directories but no "
                f"{SET_FILE}; use --accept-change to record this set"
            )
        self._set_to_record = mine  # written once every aggregation started

    def _record_set(self) -> None:
        mine, self._set_to_record = getattr(self, "_set_to_record", None), None
        if mine is None:
            return
        atomic_write(self.dir / SET_FILE, json.dumps(mine, indent=1, sort_keys=True), mode=None)

    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        """The :meth:`Aggregator.run` loop, for every aggregation at once."""
        self._log_filter = _NameInLog()
        log.addFilter(self._log_filter)
        self._lock()
        started: list[Aggregator] = []
        worker = None
        running = failed = False
        try:
            self.check_set()
            if any(a.async_releases() for a in self.aggs.values()):
                # one pool for all: their releases run in parallel, up to release.workers
                worker = ReleaseWorker(int(self.cfg.release.workers))
                for agg in self.aggs.values():
                    if agg.async_releases():
                        agg.worker = worker
            for name, agg in self.aggs.items():  # every check before any aggregation writes
                with _about(name):
                    agg._lock()
                    started.append(agg)
                    agg.check_start()
            for name, agg in self.aggs.items():
                with _about(name):
                    agg.start()  # restores its checkpoint: its view learns its offsets
            self._track_start()
            self.source.seek(self._start)
            self._position.update(self._start)
            running = True  # a refused start says why in one line, not "stopped" before it
            log.info("one consumer for %d aggregations (%s)", len(self.aggs), ", ".join(self.aggs))
            self._record_set()
            if self.on_started is not None:
                self.on_started()
            finite = self.cfg.source.kind != "kafka"
            # --exit-when-idle: the same rule as one aggregation's, over all of them
            idle = IdleExit(
                idle_exit_s, lambda: all(a.idle_can_count() for a in self.aggs.values())
            )
            share = poll_timeout_s / len(self.aggs)
            while not self.stop_event.is_set():
                # one consumer: an aggregation whose total budget is spent pauses the intake
                if any(
                    [
                        self._each(name, agg.paused_for_budget, share, finite)
                        for name, agg in self.aggs.items()
                    ]
                ):
                    if idle.over(paused=True):
                        break
                    continue
                for agg in self.aggs.values():
                    agg.intake_gap.polling()
                segments = self.source.poll(poll_timeout_s)
                for agg in self.aggs.values():
                    agg.intake_gap.polled()
                self._count(segments)
                self._track_start()
                self._health()
                if segments:
                    idle.polled()
                    continue
                if self.source.exhausted:
                    for name, agg in self.aggs.items():
                        self._each(name, agg.input_ended)
                    break
                if idle.over():
                    break
            for name, agg in self.aggs.items():
                self._each(name, agg.finish)
        except Stopping:
            log.info("stopped while waiting; the open windows are replayed at the next start")
        except BaseException:
            failed = True
            raise
        finally:
            if worker is not None:
                worker.close()
            for agg in started:
                self._each(agg.aggregation["name"], agg.close)
            self.source.close()
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None
            for agg in started if running else ():
                self._each(
                    agg.aggregation["name"],
                    agg._stop_line,
                    "on the error below" if failed else None,
                )
            if not running:  # a refused start writes nothing: remove what it created
                for agg in started:
                    agg.claim.remove_created()
                remove_created(getattr(self, "_created", []))
            log.removeFilter(self._log_filter)

    def _count(self, segments: list[Segment]) -> None:
        """One poll into every aggregation, a chunk of records at a time: each record is parsed
        once for all of them, and the parsed records live for one chunk only (held for a whole
        poll of 20,000 records, the garbage collector's passes over them cost more than the
        parses saved: docs/item_selection.md)."""
        got = dict.fromkeys(self.aggs, False)
        self._seeked.clear()
        for chunk in _chunks(segments, PARSE_CHUNK):
            chunk = [seg for seg in chunk if seg.partition not in self._seeked]
            if not chunk:
                continue
            origins = {}
            for seg in chunk:  # (a seek while the chunk is counted sets the position anew)
                origins[seg.partition] = self._position.get(seg.partition)
                self._position[seg.partition] = int(seg.offsets[-1]) + 1
            for name, agg in self.aggs.items():
                mine = self.views[name].deliver(chunk, origins)
                got[name] = got[name] or bool(mine)
                with _about(name):
                    for seg in mine:
                        agg._ingest(seg)
            self._parsed.clear()
        for name, agg in self.aggs.items():
            self._each(name, agg.housekeeping, got[name])

    @staticmethod
    def _each(name: str, step, *args):
        with _about(name):
            return step(*args)

    def _health(self) -> None:
        self.metrics.heartbeat()
        for agg in self.aggs.values():
            ready, reason = agg.metrics._ready
            if not ready:
                self.metrics.set_ready(False, f"{agg.aggregation['name']}: {reason}")
                return
        self.metrics.set_ready(True)
