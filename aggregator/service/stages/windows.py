"""The window assigner and its clock: which window a task counts into, and when it ends.

Tumbling windows, each with fresh noise and a random uid, by event count (the window is full:
:meth:`..window.WindowTask.room`), by processing time (:meth:`WindowAssigner.time_window_due`)
or by the records' event time (:class:`..event_time.EventTimeWindows`, which this assigner
opens its windows through). A window restored from a checkpoint may have a *replay target*
(:meth:`WindowAssigner.replay_target`): the ledgered end of a window already released, or the
source's end offsets for a time window that ended while the service was down; it closes there
and nowhere else. Optional layered snapshots fall at public points of the window
(:meth:`WindowAssigner.snapshot_due`).

Invariant: each event is in exactly one window (parallel composition); the boundaries depend
only on public quantities (counts, clock, offsets, ledgered ends), never on the items. The
assigner decides; the caller closes, checkpoints and releases. Writes nothing.
"""

from __future__ import annotations

import logging

from ..ledger import Ledger
from ..metrics import Metrics
from ..settings import Config
from ..window import WindowTask, new_window

__all__ = ["WindowAssigner"]

log = logging.getLogger("panagg.service")


class WindowAssigner:
    """The windows of one aggregation.

    Parameters
    ----------
    cfg
        ``window.kind`` (count, time, event_time), ``window.size`` and
        ``checkpoint.snapshots_per_window``.
    ledger
        The privacy ledger (a window's ledgered end is its replay target).
    source
        The event source (``end_offsets`` and ``caught_up`` where it has them).
    metrics
        The window progress gauge.
    event_time
        The event-time windows (``open_window``), or None until wired (set before the start).
    """

    def __init__(self, cfg: Config, ledger: Ledger, source, metrics: Metrics, *, event_time=None):
        self.kind, self.size = cfg.window.kind, cfg.window.size
        self.auto_event_time = bool(cfg.window.auto_event_time)
        self.snapshots_per_window = int(cfg.checkpoint.snapshots_per_window)
        self.ledger, self.source, self.metrics = ledger, source, metrics
        self.event_time = event_time

    def log_clock(self) -> None:
        """At a start, with ``window.clock = auto`` on Kafka: the line saying which clock cuts
        the windows (the records' timestamps, not this process's)."""
        if self.auto_event_time:
            log.info(
                "time windows of %g s by the records' Kafka timestamps (window.clock = "
                "auto): an event lands in the window of its timestamp, after a broker "
                "outage too; window.clock = process windows by this process's clock",
                self.size,
            )

    def new_window(self, task: WindowTask, window_id: int) -> dict:
        """Window ``window_id``'s record (its uid fresh); an event-time window is opened on
        the event-time clock too."""
        w = new_window(window_id, self.kind, self.size)
        if w["kind"] == "event_time":
            self.event_time.open_window(task, w)
        return w

    def replay_target(self, task: WindowTask) -> None:
        """Where replaying the restored window must stop before it closes: the ledgered end of a
        window already released, or (time windows whose end passed while down) the source's
        end offsets now."""
        entry = self.ledger.get(f"release-{task.window['uid']}")
        if entry is not None and entry.get("end_offsets") is not None:
            task.close_at = {p: int(o) for p, o in entry["end_offsets"].items()}
        elif task.window["kind"] == "time" and task.progress() >= 1:
            ends = self.end_offsets()
            task.close_at = ends if ends else None

    def end_offsets(self) -> dict[str, int] | None:
        """The source's end offsets now (None: not known)."""
        end_offsets = getattr(self.source, "end_offsets", None)
        return end_offsets() if end_offsets else None

    def caught_up(self, task: WindowTask) -> bool:
        """The source had nothing more: a replay target not reached by now never will be (a
        partition with fewer records than its end offset showed, e.g. compaction); the target
        is dropped. True if the time window is then due to close."""
        probe = getattr(self.source, "caught_up", None)
        if task.close_at is not None and (probe is None or probe(list(task.close_at))):
            task.close_at = None
            return task.window["kind"] == "time" and task.progress() >= 1
        return False

    def time_window_due(self, task: WindowTask) -> bool:
        """A processing-time window's progress (in the gauge); True once its time is up. Never
        while replaying: the window then closes when the replay reaches its target."""
        if task.window["kind"] != "time" or task.close_at is not None:
            return False
        progress = task.progress()
        self.metrics.window_progress.set(min(progress, 1.0))
        return progress >= 1

    def snapshot_due(self, task: WindowTask) -> bool:
        """Whether the next layered snapshot is due (each costs two layers in the release; they
        bound the replay after a crash to a fraction of the window); if so it is counted in
        the window (its number tags its noise)."""
        k = self.snapshots_per_window
        if not k or task.close_at is not None or task.window["snapshots"] >= k:
            return False
        if task.inflight:  # a snapshot checkpoint lists no closed windows: it waits for them
            return False
        if task.progress() >= (task.window["snapshots"] + 1) / (k + 1):
            task.window["snapshots"] += 1
            return True
        return False
