"""The streaming service: source -> decode -> count -> window close -> release, with checkpoints.

Exactly once, by replay. The open window's counters live only in memory (docs/privacy.md: a
checkpoint holding the same noise as memory would let one intrusion read the exact recent
events). A checkpoint holds where the window starts in the source (:mod:`.stages.checkpoint`);
after a crash, a stop or a handover the service counts the window again from there under fresh
noise (:mod:`.stages.resume`). A crash at any instant therefore neither loses nor double-counts
an event; it costs a replay of at most one window, which the source must retain.

Windows are tumbling (by count, processing or event time), each with fresh noise
(:mod:`.stages.windows`). A release is ledgered *with its document* before the checkpoint that
starts the next window and published from it (:mod:`.stages.close`); a window the ledger holds
is re-published, never computed again (:mod:`.stages.release`).

:class:`.wiring.Stages` builds the stages of :mod:`.stages`, one concern a module (the start and
its checks, resuming a task, fresh states, intake, the window assigner, the checkpoint sequence,
release, publishing, exports, control requests, health); :class:`Aggregator` runs the loop over
them: start, then per poll a turn (count, then housekeeping), then the input's end and finish.
"""

from __future__ import annotations

import logging
from pathlib import Path

from consumers.base import Segment

from .errors import ServiceError, Stopping
from .release_worker import ReleaseWorker
from .stages.caught_up import IdleExit, catch_up, idle_can_count
from .stages.checkpoint import log_stop
from .stages.release import release_method
from .stages.start_checks import save_effective_config
from .stages.state_dir import service_running
from .window import WindowTask
from .wiring import Stages

__all__ = ["release_method", "Aggregator", "ServiceError", "Stopping", "service_running"]

log = logging.getLogger("panagg.service")


class Aggregator(Stages):
    """One aggregator process over one :class:`Source`: the stages :class:`.wiring.Stages`
    builds (its parameters: the config, the source, the metrics, ``fresh_start``,
    ``accept_change`` and ``same_records_as``), driven by the loop below."""

    # -- the loop (multi drives its steps: start, a turn per poll, input_ended, finish) ------
    def run(self, *, idle_exit_s: float | None = None, poll_timeout_s: float = 0.5) -> None:
        """Consume until stopped (stop_event / SIGTERM), or until a finite source is exhausted."""
        self._lock()
        started = failed = False
        try:
            self.start()
            started = True  # a refused start says why in one line, not "stopped" before it
            if self.on_started is not None:
                self.on_started()
            idle = IdleExit(idle_exit_s, self.idle_can_count)
            finite = self.cfg.source.kind != "kafka"
            while not self.stop_event.is_set():
                if self.paused_for_budget(poll_timeout_s, finite):
                    if idle.over(paused=True):  # --exit-when-idle: a paused intake counts nothing
                        break
                    continue
                self.intake_gap.polling()
                segments = self.source.poll(poll_timeout_s)
                self.intake_gap.polled()
                self.turn(segments)
                if segments:
                    idle.polled()
                    continue
                if self.source.exhausted:
                    self.input_ended()
                    break
                if idle.over():  # --exit-when-idle (:class:`.stages.caught_up.IdleExit`)
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
            else:  # (the lock released: what the refused start made goes)
                self.claim.remove_created()

    def start(self) -> None:
        """Restore the checkpoint, seek the source, publish what a crash left pending."""
        self.restore()
        self.registries.attach()
        self.save_effective_config()
        if self.worker is None and self.async_releases():
            self.worker = ReleaseWorker(int(self.cfg.release.workers))
            self._owns_worker = True
        self.starting.ledger_composition(self.task)
        self.assigner.log_clock()
        self.plan.start()
        if self.gate.user_budget is not None:  # the per-user budget's start line and gauges
            log.info("%s", self.gate.user_budget_line())
            self.metrics.user_budget(self.gate.user_budget)
        self.publishing.publish_pending(self.task)

    def turn(self, segments) -> None:
        """Count one poll's segments, then the turn's housekeeping."""
        for seg in segments:
            self._ingest(seg)
        self.housekeeping(polled=bool(segments))

    def housekeeping(self, polled: bool) -> None:
        """After a poll's records are counted (``polled``: whether there were any): time
        windows, snapshots, control requests, publishing, lag, health."""
        if not polled:
            self.plan.idle()  # caught up: the start's simulated plan may take its CPU now
            if self.assigner.caught_up(self.task):
                self.close_window()
        if self.assigner.time_window_due(self.task):
            self.close_window()
        if self.cfg.window.kind == "event_time":
            self.event_time.turn(self.task)
        self._maybe_snapshot(self.task)
        if self.task.inflight:
            self.closer.collect(self.task)
        if self.rollups is not None and self.rollups.jobs:
            self.rollups.collect(self.task.pending)
        self.requests.serve()
        if self.task.pending:
            self.publishing.publish_pending(self.task)
        self.health.update_lag()
        self.health.turned()

    def paused_for_budget(self, poll_timeout_s: float, finite: bool) -> bool:
        """True while the spent budget pauses intake (:meth:`.LoopHealth.intake_paused`)."""
        if not self.health.intake_paused(finite):
            return False
        self.requests.serve()
        self.stop_event.wait(poll_timeout_s)
        return True

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
            self.closer.collect(self.task, wait=True)
        if self.rollups is not None and self.rollups.jobs:
            self.rollups.collect(self.task.pending, wait=True)
        self.publishing.publish_last(self.task)

    def close(self) -> None:
        self.registries.close()
        self.plan.close()
        self.publisher.close()
        if self.worker is not None and self._owns_worker:
            self.worker.close()  # releases not collected are replayed at the next start
            self.worker = None
        if self.dead_letters is not None:
            self.dead_letters.close()
        self.producer.close()
        self.source.close()
        self.claim.release()

    # -- the stages' entry points: the loop, other modes (multi), the CLI, the API -----------------
    def _ingest(self, seg: Segment) -> None:
        # (records deleted before they were read: :meth:`.RetentionWatch.parts`)
        for part in self.retention.parts(
            seg, self.task.offsets, lambda gone: self.closer.withhold_deleted(self.task, gone)
        ):
            if self.cfg.window.kind == "event_time":
                self.event_time.ingest(part)
                continue
            items, good, rejected = self.intake.decode(part)
            self.intake.count_segment(self.task, part, items, good, rejected, self.close_window)

    def _maybe_snapshot(self, task: WindowTask) -> None:
        """A layered snapshot checkpoint when one is due (:meth:`.WindowAssigner.snapshot_due`)."""
        if self.assigner.snapshot_due(task):
            self.commit(task, snapshot=True, tag=(task.window["snapshots"],))

    def commit(self, task: WindowTask, *, snapshot: bool = False, tag: tuple = ()) -> bytes | None:
        """``task``'s position made durable (:meth:`.Checkpoints.commit`); a snapshot returned."""
        return self.checkpoints.commit(task, snapshot=snapshot, tag=tag)

    def close_window(self) -> dict | None:
        """Release the open window (if the budget allows) and start the next one, durably
        (:meth:`.Closer.close`); beside the loop the return value is ``{"window": id}``."""
        self.metrics.intake_stall.set(self.intake_gap.take())
        return self.closer.close(self.task)

    def async_releases(self) -> bool:
        """Whether releases run beside the loop (:meth:`.ReleaseStep.beside_loop`)."""
        return self.releases.beside_loop()

    def export(self, export_id: str | None = None) -> Path:
        """A signed audit export with fresh layers around it (:meth:`.AuditExports.export`)."""
        return self.exports.export(self.task, export_id)

    def _lock(self) -> None:
        self.claim.claim()  # what this start creates is removed again if it is refused
        self.control.mkdir(exist_ok=True)

    def save_effective_config(self) -> None:
        """Keep the running config next to the checkpoints (:func:`.save_effective_config`)."""
        save_effective_config(self.dir, self.cfg)

    def check_start(self) -> None:
        """Every check of a start, before anything is written (:meth:`.Start.check`)."""
        self.starting.check(self.task)

    def restore(self) -> None:
        """Every check, then the checkpoint restored, the source sought (:meth:`.Start.restore`)."""
        self.starting.restore(self.task)

    def idle_can_count(self) -> bool:
        """Whether an empty turn counts towards --exit-when-idle (:mod:`.stages.caught_up`)."""
        return idle_can_count(self.source, self.intake.held)

    def _stop_line(self, reason: str | None = None) -> None:
        """What a restart will find: the last checkpoint and what is replayed from it."""
        log_stop(
            getattr(self, "task", None),
            reason or ("stop requested" if self.stop_event.is_set() else "input ended or idle"),
        )

    def catch_up(self, timeout_s: float = 120.0) -> None:
        """Count what the source holds now, for offline commands (:func:`.stages.caught_up`)."""
        catch_up(
            self.source,
            lambda: self.intake.held,
            ingest=self._ingest,
            snapshot=lambda: self._maybe_snapshot(self.task),
            bootstrap=self.cfg.source.bootstrap,
            timeout_s=timeout_s,
        )
