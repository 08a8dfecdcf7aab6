"""The one process's stages, built and connected: what :class:`.process.Aggregator` runs.

Quix Streams' ``app.py`` wires and its loop runs; here :class:`Stages` builds every stage of
:mod:`.stages` in the order they depend on each other (the budget before the checks that read
the ledger, the release step before the closer that calls it, the start last) and hands each
the callbacks it needs into the others, and :class:`.process.Aggregator` adds the loop that
drives them. Nothing here reads the source or writes anything: the start does
(:mod:`.stages.start`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from consumers.base import Source

from .accuracy_plan import StartPlan
from .deadletter import DeadLetters
from .event_time import EventTimeWindows
from .intake_gap import IntakeGap
from .metrics import Metrics
from .rejects import RejectLog, RejectWatch
from .settings import Config
from .stages.budget import open_budget
from .stages.checkpoint import Checkpoints
from .stages.close import Closer
from .stages.control import ControlRequests
from .stages.export import AuditExports
from .stages.fresh_state import FreshStates
from .stages.health import LoopHealth
from .stages.intake import Intake, decoder_for
from .stages.producer import SharedProducer
from .stages.publish import PublishStep
from .stages.registries import BudgetRegistries
from .stages.release import ReleaseStep, rollups_for
from .stages.resume import Resume
from .stages.retention import RetentionWatch
from .stages.start import Start
from .stages.start_checks import StartChecks, keep_processing_time
from .stages.state_dir import DirectoryClaim
from .stages.windows import WindowAssigner
from .window import WindowTask

__all__ = ["Stages"]

log = logging.getLogger("panagg.service")


class Stages:
    """The stages of one aggregator process over one :class:`Source`, wired (the loop that
    drives them: :class:`.process.Aggregator`).

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
