"""A start in two phases: every check while writing nothing, then the restore that writes.

A refused start leaves the state directory as it was: no ledger entry, no checkpoint. So a start
first runs every check (:meth:`Start.check`): the file budget registry prepared, the latest
checkpoint against the ledger's anchors, the settings' identity, the task resumed from its
checkpoint (:class:`.resume.Resume`), a renamed file's registry carried over, the open window's
replay still held by the source. The ledger entries these checks decide on (identity, restart,
fresh start) are held by :meth:`Start.append`, not written. Several aggregations run all their
checks before any of them writes: one refused refuses the start, which then wrote nothing.

Then :meth:`Start.restore` writes: the held entries, a first checkpoint if the task moved (from
then on a missing checkpoint is a lost one), the source sought to the checkpoint's offsets, the
metrics set from the checkpoint's totals (each record after it is then counted once: exact after
restarts), rollups ledgered but not yet published taken from the ledger, and rollup views kept
before a stop folded, each once.

Durable writes: ledger entries (held until the checks pass) and the first checkpoint (through
``commit``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from state_store.local import LocalStore

from ..ledger import Ledger
from ..metrics import Metrics
from ..rollup_closer import RollupCloser, ledgered_unpublished_rollups
from ..window import WindowTask
from .registries import BudgetRegistries
from .resume import Resume
from .start_checks import StartChecks

__all__ = ["Start"]


class Start:
    """The start of one aggregation's task.

    Parameters
    ----------
    ledger
        The privacy ledger (entries held while checking, the budget's metrics).
    checks, registries, resume
        The start's lineage checks, the budget registries and where the task resumes.
    metrics
        Set from the restored checkpoint's totals.
    source
        The event source (sought to the checkpoint's offsets).
    commit
        ``commit(task)``: makes the task's position durable.
    rollups
        The rollup closer (None without ``window.rollups``).
    directory, release_dir
        ``checkpoint.dir`` and ``release.dir``.
    """

    def __init__(
        self,
        ledger: Ledger,
        checks: StartChecks,
        registries: BudgetRegistries,
        resume: Resume,
        metrics: Metrics,
        source,
        *,
        commit: Callable[[WindowTask], object],
        rollups: RollupCloser | None,
        directory: Path,
        release_dir,
    ):
        self.ledger, self.checks, self.registries, self.resume = ledger, checks, registries, resume
        self.metrics, self.source, self.commit, self.rollups = metrics, source, commit, rollups
        self.dir, self.release_dir = Path(directory), release_dir
        #: ledger entries a start decided on, written only once every start check has passed
        self.deferred: list[dict] | None = None
        self.checked: list[dict] | None = None  # the checks passed: their ledger entries

    def append(self, **entry) -> None:
        """A ledger entry: held while a start is checking, else written at once."""
        if self.deferred is not None:
            self.deferred.append(entry)
            return
        self.ledger.append(**entry)

    def check(self, task: WindowTask) -> None:
        """Every check of a start, before anything is written (the module docstring)."""
        task.store = LocalStore(self.dir / "checkpoints")
        self.deferred = []
        try:
            self.registries.prepare_file()
            self.checks.check_anchors(task.store.load_latest())
            self.checks.check_identity()
            self.resume.restore_task(task, where=str(task.store.dir))  # committed by restore
            self.registries.carry_renamed_file(task)
            self.resume.withhold_deleted(task)
            self.checks.check_replayable(task.offsets)
            self.checked, self.deferred = self.deferred, None
        except BaseException:
            self.deferred = None
            raise

    def restore(self, task: WindowTask) -> None:
        """Check (unless done), then write what the checks decided and seek the source."""
        if self.checked is None:
            self.check(task)
        deferred, self.checked = self.checked or [], None
        for entry in deferred:
            self.append(**entry)
        moved = task.durable is None or task.durable.window.get("uid") != task.window.get("uid")
        if moved and not task.queue and task.close_at is None:
            self.commit(task)  # from now on a missing checkpoint is a lost one
        self.source.seek(task.offsets)
        # the totals of the checkpoint, then every record after it once: exact after restarts
        m = self.metrics
        m.events.inc(task.totals["events"])
        for reason, count in task.totals["rejects"].items():
            m.decode_errors.labels(reason=reason).inc(count)
        m.filtered.inc(task.totals.get("filtered", 0))
        m.window_id.set(task.window["id"])
        m.window_events.set(task.window["events"])
        m.budget(self.ledger.spent(), self.ledger.remaining())
        # a rollup ledgered but not yet published is published from the ledger; views kept
        # before a stop are folded (each once)
        ledgered_unpublished_rollups(self.ledger, self.release_dir, task.pending)
        if self.rollups is not None:
            self.rollups.fold(task.pending)

    def ledger_composition(self, task: WindowTask) -> None:
        """With several aggregations: the set this one is part of, in its ledger, whenever it
        differs from the last one recorded (:meth:`.StartChecks.composition_entry`)."""
        entry = self.checks.composition_entry(task.window["id"])
        if entry is not None:
            self.append(**entry)
