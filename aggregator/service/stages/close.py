"""Closing a window: the release step, the next window, the checkpoint, in their order.

In the loop (no release worker, or a restored snapshot's window): the release is computed once
and ledgered with its document (:meth:`.ReleaseStep.ledgered_release`), then the next window
opens and one checkpoint makes its start and the pending release durable together. Beside the
loop (``release.workers`` > 0): the ledger is asked over the window's source ranges before any
release noise, the closed counters go to the worker, the next window opens at once and a
position checkpoint lists the closed, unreleased window with its end; finished releases are
ledgered and published in window order (:meth:`Closer.collect`). At ``release.max_in_flight``
windows waiting, intake pauses (:meth:`Closer.wait_for_room`). Event time: the checkpoint that
starts the next window waits until this window's release is ledgered
(:meth:`Closer.commit_start`).

Invariant: no checkpoint passes a window whose release is not ledgered (or listed as
unreleased with its end, so a restart replays and releases it once). Durable writes: the
checkpoints (through ``commit`` and :class:`.checkpoint.Checkpoints`), the ledger entries
(through :class:`.release.ReleaseStep` and the gate).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FuturesTimeout

from state_store.failpoints import failpoint

from ..errors import Stopping
from ..ledger import Ledger
from ..metrics import Metrics
from ..release_gate import ReleaseGate, covered_ranges
from ..window import WindowTask
from .checkpoint import Checkpoints
from .health import LoopHealth
from .release import ReleaseStep
from .retention import stop_for_deleted
from .windows import WindowAssigner
from .withhold import withhold_window

__all__ = ["Closer"]

log = logging.getLogger("panagg.service")


class Closer:
    """Closes one aggregation's windows.

    Parameters
    ----------
    releases
        The release step (in the loop, or submitted to the worker and ledgered when done).
    gate, ledger
        The release gate and the privacy ledger.
    windows
        The window assigner (the next window, a replay target).
    checkpoints
        The checkpoint sequence (position checkpoints).
    metrics, health
        Window and release gauges; lag while intake waits for the worker.
    event_time
        The event-time windows (the second window's state and fields).
    max_in_flight
        ``release.max_in_flight``.
    new_state
        ``new_state(task, window_id)``: window ``window_id``'s fresh state.
    commit
        ``commit(task)``: a checkpoint of the task's position (the service's, so that a
        failpoint or a test sees each one).
    publish
        ``publish(task)``: deliver the task's ledgered releases.
    worker
        ``worker()``: the release worker now, or None (releases in the loop).
    stopping
        ``stopping()``: True once a stop was requested.
    rollups
        The rollup closer, or None.
    """

    def __init__(
        self,
        releases: ReleaseStep,
        gate: ReleaseGate,
        ledger: Ledger,
        windows: WindowAssigner,
        checkpoints: Checkpoints,
        metrics: Metrics,
        health: LoopHealth,
        *,
        event_time,
        max_in_flight: int,
        new_state: Callable,
        commit: Callable[[WindowTask], object],
        publish: Callable[[WindowTask], None],
        worker: Callable,
        stopping: Callable[[], bool],
        rollups=None,
    ):
        self.releases, self.gate, self.ledger, self.windows = releases, gate, ledger, windows
        self.checkpoints, self.metrics, self.health = checkpoints, metrics, health
        self.event_time, self.max_in_flight = event_time, max_in_flight
        self.new_state, self.commit, self.publish = new_state, commit, publish
        self.worker, self.stopping, self.rollups = worker, stopping, rollups

    def close(self, task: WindowTask) -> dict | None:
        """Release ``task``'s window (if the budget allows) and start the next one, durably.
        With a release worker, the release is computed beside the loop and collected later in
        window order (:meth:`collect`); the return value is then ``{"window": id}``."""
        worker = self.worker()
        if worker is not None and task.window_start is not None:
            return self.close_async(task, worker)
        t0 = time.perf_counter()
        closing = dict(task.window, ended_unix=time.time())
        wid, uid = closing["id"], closing["uid"]
        release = self.releases.ledgered_release(
            task, closing, lambda ranges: self.position_fields(task, closing, ranges)
        )
        if release is not None:
            task.pending.append(json.dumps(release, allow_nan=False))
            if self.rollups is not None:
                self.rollups.fold(task.pending)
        if task.queue:  # after a restart: the next closed window to replay, or the open one
            self.open_next(task, closing)
            if not task.queue and task.close_at is None:
                self.commit(task)
            self.publish(task)
            return release
        task.close_at = None
        task.window = self.windows.new_window(task, wid + 1)
        # where the next window's records start (an event-time second window: where its
        # replay starts), and the chain of checkpoints it belongs to
        task.window.update(
            lineage=closing.get("lineage"),
            start_offsets=dict((task.replay or {}).get("offsets") or task.offsets),
        )
        task.mark_start()
        carried = self.event_time.carried_state()  # the second window, counting already
        task.state = carried if carried is not None else self.new_state(task, wid + 1)
        self.metrics.window_id.set(wid + 1)
        self.metrics.window_events.set(task.window["events"])
        self.metrics.window_progress.set(0)
        self.commit(task)  # the next window's start and the pending release, atomically
        self.publish(task)
        self.metrics.release_duration.observe(time.perf_counter() - t0)
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining(), self.gate.user_budget)
        log.debug("closed window %s (uid %s)", wid, uid)
        return release

    # -- records deleted before they were read --------------------------------------------------
    def withhold_deleted(self, task: WindowTask, gone: dict[str, tuple[int, int]]) -> None:
        """The topic's retention deleted records of the open window before the loop read them
        (``gone``: ``{partition: (due, first left)}``, :class:`.retention.RetentionWatch`):
        withhold the window with the entry a restart writes (:func:`.withhold.withhold_window`:
        its ranges are the records it counted, its note names the deleted ones) and start the
        next window at the first records left, durably. Counted on, the window would be
        released short of its range. Releases in flight are ledgered first (window order).
        Where the window cannot be withheld here (an event-time window, a restart's replay, a
        restored snapshot's window: where its records start is not known) the service stops
        with one line and the next start withholds it (:meth:`.resume.Resume.withhold_deleted`)."""
        why = (
            "an event-time window"
            if task.window.get("kind") == "event_time"
            else "replayed after a restart"
            if task.queue
            else "restored from a snapshot"
            if task.window_start is None
            else None
        )
        if why is not None:
            raise stop_for_deleted(gone, task.window["id"], why)
        if task.inflight:
            self.collect(task, wait=True)
        closing = task.window
        wid = closing["id"]
        ends = dict(task.offsets, **{p: int(b) for p, (_, b) in gone.items()})
        withhold_window(
            task,
            gone,
            gate=self.gate,
            append=self.ledger.append,
            model=self.releases.model,
            ranges=self.window_ranges(task),
            ends=ends,
            totals=task.totals,
            events=closing["events"],
            seen="seen while running: the window cannot be released whole; "
            "counting goes on from the first record left",
        )
        task.offsets.update(ends)  # (in place: a Kafka source seeks a reassignment to it)
        task.close_at = None
        task.window = self.windows.new_window(task, wid + 1)
        task.window.update(lineage=closing.get("lineage"), start_offsets=dict(ends))
        task.mark_start()
        task.state = self.new_state(task, wid + 1)
        self.metrics.window_id.set(wid + 1)
        self.metrics.window_events.set(0)
        self.metrics.window_progress.set(0)
        self.commit(task)  # the next window's start: a restart does not replay the withheld one

    # -- releases beside the loop ---------------------------------------------------------------
    def close_async(self, task: WindowTask, worker) -> dict:
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
        elif self.gate.allows(
            uid,
            wid,
            ranges=ranges,
            charge=charge,
            closing=closing,
            in_flight=task.inflight,
            refusal_fields=lambda: self.position_fields(task, closing, ranges),
        ):
            self.wait_for_room(task)
            job = self.releases.submit(
                worker, task, closing, start=start, ranges=ranges, charge=charge, extra=extra
            )
            task.inflight.append(job)
            failpoint("release-submitted")
        elif event_time and task.inflight:
            # refused: its entry is in the ledger; the checkpoint that passes it follows the
            # releases still in flight (rare: the budget is spent)
            self.collect(task, wait=True)
        self.open_next(task, closing)
        self.metrics.release_queue.set(len(task.inflight))
        if event_time:
            # the checkpoint that starts the next window is written once this window's release
            # is ledgered (:meth:`collect`): until then a restart replays this window
            # from its start (a stop in between: the restart sees the entry and passes it)
            if job is not None:
                job["checkpoint"] = task.record(None)
            elif not task.inflight:
                self.commit(task)
        elif not task.queue and task.close_at is None:
            self.commit_position(task)
        log.debug("closed window %s (uid %s)", wid, uid)
        return {"window": wid}

    def open_next(self, task: WindowTask, closing: dict) -> None:
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
            task.window = self.windows.new_window(task, wid + 1)
            # (event time: the second window's records start before this window's close)
            task.window.update(
                lineage=closing.get("lineage"),
                start_offsets=dict((task.replay or {}).get("offsets") or task.offsets),
            )
        task.mark_start()
        carried = self.event_time.carried_state()  # the second window, counting already
        task.state = carried if carried is not None else self.new_state(task, task.window["id"])
        if task.close_at is None:
            self.windows.replay_target(task)  # a time window that ended while the service was down
        self.metrics.window_id.set(task.window["id"])
        self.metrics.window_events.set(0)
        self.metrics.window_progress.set(0)

    def wait_for_room(self, task: WindowTask) -> None:
        """Backpressure: at ``release.max_in_flight`` closed windows waiting for their release,
        intake pauses (one line, ``panagg_intake_paused``) until the oldest is released."""
        limit = int(self.max_in_flight)
        if len(task.inflight) < limit:
            return
        log.warning(
            "the release path is behind (%d closed windows waiting, "
            "release.max_in_flight = %d): intake pauses until window %s is released",
            len(task.inflight),
            limit,
            task.inflight[0]["window"]["id"],
        )
        self.metrics.intake_paused.set(1)
        while len(task.inflight) >= limit:
            try:
                task.inflight[0]["future"].exception(timeout=0.5)
            except FuturesTimeout:  # meanwhile: true lag, health, a stop request
                self.metrics.heartbeat()
                self.health.update_lag(now=True)
                if self.stopping():
                    raise Stopping() from None
                continue
            self.collect(task, commit=False)
        self.metrics.intake_paused.set(0)

    def collect(self, task: WindowTask, *, wait: bool = False, commit: bool = True) -> int:
        """Ledger, checkpoint and publish the worker's finished releases in window order (with
        ``wait``: every one in flight). Returns how many were collected."""
        done, committed = self.releases.ledger_finished(
            task, wait=wait, on_checkpoint=self.commit_start
        )
        if done:
            if committed:
                self.publish(task)
            elif commit and not task.queue and task.close_at is None:
                self.commit_position(task)
                self.publish(task)
        return done

    def commit_start(self, task: WindowTask, record) -> None:
        """Event time: the checkpoint that starts the window after one whose release is now
        ledgered (as the close in the loop writes it), with the current pending releases."""
        record.pending = list(task.pending)
        self.checkpoints.save_position(task, record)
        future = self.event_time.future
        if future is not None:  # a restart starts here now: older decisions are moot
            future.prune(self.event_time.replay_starts(record))

    def commit_position(self, task: WindowTask) -> None:
        """A checkpoint while windows are in flight or the open window counts: the replay
        starts at the first unreleased window (or the open window's start), and the closed,
        unreleased windows are listed with their ends (the commit sequence of
        :meth:`.Checkpoints.commit` without a snapshot)."""
        self.checkpoints.save_position(task, task.record_position())

    def window_ranges(self, task: WindowTask, window: dict | None = None) -> dict:
        """The source positions the window covers (:func:`.release_gate.covered_ranges`): what
        its release charges in the ledger."""
        window = task.window if window is None else window
        return covered_ranges(window.get("start_offsets"), task.offsets)

    def position_fields(self, task: WindowTask, closing: dict, ranges: dict) -> dict:
        """The gate's position fields at the task's current position (event time: and what
        the entry records of the second window)."""
        fields = self.gate.position_fields(closing, ranges, task.offsets, task.totals)
        if closing.get("kind") == "event_time":
            fields.update(self.event_time.second_window_fields())
        return fields
