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

:class:`Aggregator` wires the stages of :mod:`.stages`, one concern a module (the start and its
checks, resuming a task, fresh states, intake, the window assigner, the checkpoint sequence,
release, publishing, exports, control requests, health), and runs the loop: start, then per
poll a turn (count, then housekeeping), then the input's end and finish.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from consumers.base import Segment, Source

from .accuracy_plan import StartPlan
from .deadletter import DeadLetters
from .errors import ServiceError, Stopping
from .event_time import EventTimeWindows
from .intake_gap import IntakeGap
from .metrics import Metrics
from .rejects import RejectLog, RejectWatch
from .release_worker import ReleaseWorker
from .settings import Config
from .stages.budget import open_budget
from .stages.caught_up import IdleExit, catch_up, idle_can_count
from .stages.checkpoint import Checkpoints, log_stop
from .stages.close import Closer
from .stages.control import ControlRequests
from .stages.export import AuditExports
from .stages.fresh_state import FreshStates
from .stages.health import LoopHealth
from .stages.intake import Intake, decoder_for
from .stages.producer import SharedProducer
from .stages.publish import PublishStep
from .stages.registries import BudgetRegistries
from .stages.release import ReleaseStep, release_method, rollups_for
from .stages.resume import Resume
from .stages.retention import RetentionWatch
from .stages.start import Start
from .stages.start_checks import StartChecks, keep_processing_time, save_effective_config
from .stages.state_dir import DirectoryClaim, service_running
from .stages.windows import WindowAssigner
from .window import WindowTask

__all__ = ["release_method", "Aggregator", "ServiceError", "Stopping", "service_running"]

log = logging.getLogger("panagg.service")


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

    #: the stages that read the source (a later assignment of ``source`` reaches each)
    _SOURCE_STAGES = (
        "checks",
        "registries",
        "intake",
        "health",
        "checkpoints",
        "assigner",
        "resume",
        "starting",
        "retention",
    )

    @property
    def source(self) -> Source:
        """The event source."""
        return self._source

    @source.setter
    def source(self, source: Source) -> None:
        # a source set after construction (a test's stand-in, a restart's) must reach the
        # stages too: they hold it for their probes (lag, seeks, committed offsets)
        self._source = source
        for name in self._SOURCE_STAGES:
            stage = self.__dict__.get(name)
            if stage is not None:
                stage.source = source

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
        self.cfg = cfg = Config.from_mapping(cfg)
        #: --same-records-as: the topic whose records source.topic holds copies of
        self.same_records_as = same_records_as
        self.source = source
        self.metrics = metrics or Metrics()
        st = cfg.state
        self.epsilon, self.model, self.loss = float(st.epsilon), st.model, st.loss
        #: each window's fresh state (user: a density state, direct: a dense domain) and the rng
        self.states = FreshStates(cfg, worker=lambda: self.worker)
        self.user, self.direct, self.size = self.states.user, self.states.direct, self.states.size
        self._rng, self._new_state = self.states.rng, self.states.take
        self.decoder = decoder_for(cfg, self.size if self.direct else None)
        self.dir = Path(cfg.checkpoint.dir)
        self.fresh_start, self.accept_change = fresh_start, accept_change
        self.task = WindowTask("all", None)
        #: a name for this aggregation in anchors and charges ("" when it is the only one)
        self.aggregation = cfg.aggregation
        self.anchor_name = self.aggregation.name if self.aggregation else ""
        #: the privacy ledger and the gate asked before any release noise (:mod:`.stages.budget`)
        self.ledger, self.gate = open_budget(cfg, self.dir, self.metrics, user=self.user)
        self.cfg = cfg = keep_processing_time(cfg, self.ledger, self.dir)
        #: the lineage checks of a start (:mod:`.stages.start_checks`)
        self.checks = StartChecks(
            cfg,
            self.ledger,
            self.dir,
            source,
            append=lambda **e: self._ledger_append(**e),
            accept_change=accept_change,
            fresh_start=fresh_start,
            same_records_as=same_records_as,
            anchor_name=self.anchor_name,
        )
        #: the budget registry of the source, attached to the gate (:mod:`.stages.registries`)
        self.registries = BudgetRegistries(cfg, self.dir, source, self.gate, self.ledger)
        #: the start's accuracy plan in the log (a thread simulates the expected errors)
        self.plan = StartPlan(cfg)
        #: close and release: in the loop or beside it (:mod:`.stages.release`)
        self.releases = ReleaseStep(
            cfg,
            self.ledger,
            self.gate,
            self.metrics,
            epsilon=self.epsilon,
            model=self.model,
            loss=self.loss,
            rng=self._rng,
        )
        #: window.rollups (:mod:`.rollup_closer`; sums under dir/rollups), None without them
        self.rollups = rollups_for(
            cfg,
            self.dir,
            self.gate,
            self.metrics,
            annotate=self.releases.annotate,
            worker=lambda: self.worker,
        )
        self.releases.rollups = self.rollups
        self.control = self.dir / "control"
        #: checkpoint.dir's lock, and what a refused start made (:mod:`.stages.state_dir`)
        self.claim = DirectoryClaim(self.dir, self.control, self.dir / "checkpoints")
        #: panagg release / export asking the running loop (:mod:`.stages.control`)
        self.requests = ControlRequests(
            self.control, export=lambda rid: self.export(rid), release=lambda: self.close_window()
        )
        self.producer = SharedProducer(cfg)  #: made on first use
        topic, name = cfg.source.dead_letter_topic, self.aggregation and self.aggregation.name
        self.dead_letters = (
            DeadLetters(topic, self.producer.get, self.metrics, name or None) if topic else None
        )
        self.stop_event = threading.Event()
        self.reject_watch, self.reject_log = RejectWatch(cfg), RejectLog()
        self.intake_gap = IntakeGap()  # the longest stall of intake per window
        self.retention = RetentionWatch(source)  # records deleted before they were read
        #: decode and count each polled segment into the open window (:mod:`.stages.intake`)
        self.intake = Intake(
            self.decoder,
            source,
            self.metrics,
            direct=self.direct,
            reject_watch=self.reject_watch,
            reject_log=self.reject_log,
            dead_letters=self.dead_letters,
        )
        #: lag, broker state, progress line, readiness, the budget pause (:mod:`.stages.health`)
        self.health = LoopHealth(
            self.metrics,
            source,
            self.ledger,
            self.epsilon,
            positions=lambda: dict(self.task.offsets),
            reject_log=self.reject_log,
            dead_letters=self.dead_letters,
            user_budget=self.gate.user_budget,
            stall_timeout_s=cfg.source.stall_timeout_s,
        )
        #: the checkpoint sequence (:mod:`.stages.checkpoint`)
        self.checkpoints = Checkpoints(
            self.ledger,
            self.metrics,
            source,
            self.dir,
            dead_letters=self.dead_letters,
            anchor_name=self.anchor_name,
            rng=self._rng,
            wait=lambda s: self.stop_event.wait(s),
        )
        #: delivery of the ledgered releases (:mod:`.stages.publish`)
        self.publishing = PublishStep(
            cfg.release.dir,
            cfg.release.topic,
            self.ledger,
            self.metrics,
            producer=self.producer.get,
            plot=cfg.release.plots,
            save_pending=self.checkpoints.save_pending,
        )
        self.publisher = self.publishing.publisher
        #: event-time windows (window.kind = event_time; :mod:`.event_time`)
        self.event_time = EventTimeWindows(self)
        #: which window a record counts into, and when it ends (:mod:`.stages.windows`)
        self.assigner = WindowAssigner(
            cfg, self.ledger, source, self.metrics, event_time=self.event_time
        )
        #: closing a window: release, next window, checkpoint (:mod:`.stages.close`)
        self.closer = Closer(
            self.releases,
            self.gate,
            self.ledger,
            self.assigner,
            self.checkpoints,
            self.metrics,
            self.health,
            event_time=self.event_time,
            max_in_flight=int(cfg.release.max_in_flight),
            new_state=self.states.take,
            commit=lambda task: self.commit(task),
            publish=lambda task: self.publishing.publish_pending(task),
            worker=lambda: self.worker,
            stopping=lambda: self.stop_event.is_set(),
            rollups=self.rollups,
        )
        #: where the task resumes at a start (:mod:`.stages.resume`)
        self.resume = Resume(
            self.ledger,
            self.checks,
            self.registries,
            self.gate,
            self.assigner,
            source,
            event_time=self.event_time,
            states=self.states,
            append=lambda **e: self._ledger_append(**e),
            model=self.model,
            fresh_start=fresh_start,
            directory=self.dir,
            group=cfg.source.group,
        )
        #: the start: every check, then the writes it decided (:mod:`.stages.start`)
        self.starting = Start(
            self.ledger,
            self.checks,
            self.registries,
            self.resume,
            self.metrics,
            source,
            commit=lambda task: self.commit(task),
            rollups=self.rollups,
            directory=self.dir,
            release_dir=cfg.release.dir,
        )
        #: a ledger entry (held while a start checks: a refused start writes nothing)
        self._ledger_append = self.starting.append
        #: announced audit exports (:mod:`.stages.export`)
        self.exports = AuditExports(
            cfg.audit.key_file,
            Path(cfg.audit.dir or self.dir / "exports"),
            self.metrics,
            model=self.model,
            user=self.user,
            event_time=self.event_time,
            commit=lambda task, **kw: self.commit(task, **kw),
            collect=lambda task: self.closer.collect(task, wait=True),
            append=self._ledger_append,
        )
        #: the release worker (:mod:`.release_worker`; None: in the loop; multi sets a shared one)
        self.worker = None
        self._owns_worker = False
        self.release_runs = self.releases.runs  #: the worker's release timings (ReleaseStep.runs)
        #: called once the start succeeded (the CLI leaves the metrics URL for panagg status)
        self.on_started = None
        self.metrics.epsilon.set(self.epsilon)

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
