"""Announced audit exports: a signed view of the open window for an auditor (``panagg export``).

An export is the layered snapshot of a checkpoint (:meth:`.checkpoint.Checkpoints.commit` with
``snapshot``): a fresh DLap layer on the live counters, the snapshot, another fresh layer. So
the export is a noised view like any intrusion's (docs/privacy.md), and being a checkpoint a
restart resumes from it instead of drawing noise the export did not see. It is ledgered
(``kind = export``, no budget: announced, its layers are fresh) before it is signed with the
audit key (:func:`state_store.audit.write_export`) and written to ``audit.dir``.

Refused: an export of a user-level density state (``state.privacy_unit = user``: a second look
at its bits is not covered, docs/privacy_unit.md); not built: one while two event-time windows
are live (the window in its allowed lateness and the next one counting already).
Releases computed beside the loop are collected first: the export's checkpoint holds no list of
unreleased windows.

Durable writes: the snapshot checkpoint (through ``commit``), the ``export`` ledger entry, the
signed export file (a noised view).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from state_store.audit import load_key, write_export

from ..errors import ServiceError
from ..metrics import Metrics
from ..user_window import NO_EXPORT
from ..window import WindowTask

__all__ = ["AuditExports"]

log = logging.getLogger("panagg.service")


class AuditExports:
    """The audit exports of one aggregation.

    Parameters
    ----------
    key_file, out_dir
        ``audit.key_file`` ("" or None: the environment's key) and where exports go.
    metrics
        Counts the exports written.
    model
        The counter model (in the ledger entry).
    user
        ``state.privacy_unit = user`` (no export).
    event_time
        The event-time windows (whether a second window is live).
    commit
        ``commit(task, snapshot=True, tag=...)``: the layered snapshot checkpoint, returned.
    collect
        ``collect(task)``: waits for the releases beside the loop and ledgers them.
    append
        ``append(**entry)``: a ledger entry.
    """

    def __init__(
        self,
        key_file: str | None,
        out_dir: Path,
        metrics: Metrics,
        *,
        model: str,
        user: bool,
        event_time,
        commit: Callable[..., bytes],
        collect: Callable[[WindowTask], object],
        append: Callable[..., None],
    ):
        self.key_file, self.out_dir, self.metrics = key_file, Path(out_dir), metrics
        self.model, self.user, self.event_time = model, user, event_time
        self.commit, self.collect, self.append = commit, collect, append
        self.seq = 0

    def export(self, task: WindowTask, export_id: str | None = None) -> Path:
        """Signed snapshot for auditors, with fresh layers just before and just after it."""
        if self.user:
            raise ServiceError(NO_EXPORT)
        key = load_key(self.key_file or None)
        if self.event_time.second is not None and self.event_time.second.events:
            raise ServiceError(
                f"an audit export while two event-time windows are live is not built (window "
                f"{task.window['id']} is open within window.allowed_lateness_s while the "
                "next one counts already); request it again once that window has closed"
            )
        if task.inflight:  # the export's checkpoint holds no list of unreleased windows
            self.collect(task)
        self.seq += 1
        export_id = export_id or f"{int(time.time())}-{task.window['id']}-{self.seq}"
        return self._export_task(task, export_id, key)

    def _export_task(self, task: WindowTask, export_id: str, key: bytes) -> Path:
        """Export ``task``'s state: the layered snapshot of a checkpoint (so a restart resumes
        from it instead of drawing noise the export did not see), ledgered, then signed."""
        snapshot = self.commit(task, snapshot=True, tag=(1000 + self.seq,))
        self.append(
            entry_id=f"export-{export_id}",
            kind="export",
            window=task.window["id"],
            window_uid=task.window["uid"],
            epsilon_spent=0.0,
            model=self.model,
            note="announced export; fresh DLap layers before and after",
        )
        path = write_export(
            self.out_dir / f"export-{export_id}.panagg",
            state=snapshot,
            window=task.window,
            offsets=task.offsets,
            export_id=export_id,
            key=key,
        )
        self.metrics.exports.inc()
        log.info("audit export %s written to %s", export_id, path)
        return path
