"""The checkpoint sequence: where a window task stands in the source, made durable.

A checkpoint holds where the open window starts in the source, the totals up to there and the
releases not yet published; never the live counters (``process``'s module docstring: a file
holding memory's noise would let one intrusion read the exact recent events). Optionally it
holds a *layered snapshot*: a view with a fresh noise layer on each side. A restart counts the
open window again from its checkpoint, so the source must retain one window (or one snapshot
interval); the start checks it for Kafka time windows, and a window the source no longer holds
stops the service with one line.

The numbered sequence of :meth:`Checkpoints.commit`:

1. dead letters of every record before the new offsets are acknowledged by the broker;
2. (snapshot only) a fresh noise layer on the live counters, the snapshot, another fresh layer;
3. the checkpoint is written atomically (the task's store: temp file, fsync, rename, directory
   fsync), with the ledger's head (an older ledger is refused at the next start);
4. the offsets go to the Kafka group, for lag monitoring only, with the ledger's head as anchor.

Invariant: a checkpoint never says more events are counted than memory holds (a commit without
a snapshot inside a window is refused). Each write is retried with backoff until it succeeds or
a stop is requested (:class:`..errors.Stopping`: the window is replayed at the next start).
Durable writes: the task's checkpoint files (offsets, totals, pending release documents, and a
snapshot that is a noised view). At a stop, :func:`log_stop` says what a restart will find.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from ..anchor import kafka_metadata
from ..ledger import Ledger
from ..metrics import Metrics
from ..window import WindowTask
from .durable_write import wait_for_write

__all__ = ["Checkpoints", "log_stop"]

log = logging.getLogger("panagg.service")


def log_stop(task: WindowTask | None, reason: str) -> None:
    """The stop line: the open window, the last checkpoint and what is replayed from it."""
    win = getattr(task, "window", None) or {}
    durable = getattr(task, "durable", None)
    if not win:
        log.info("stopped (%s)", reason)
        return
    where = ""
    if durable is not None:
        where = (
            f" (checkpoint {durable.seq}, at offsets "
            f"{', '.join(f'{k}: {v}' for k, v in sorted(durable.offsets.items()))})"
        )
    log.info(
        "stopped (%s): window %s open with %s events; the last checkpoint holds its "
        "start%s, so the next start replays it from the source",
        reason,
        win.get("id"),
        f"{int(win.get('events', 0)):,}",
        where,
    )


class Checkpoints:
    """Writes a :class:`..window.WindowTask`'s checkpoints (the sequence above).

    Parameters
    ----------
    ledger
        The privacy ledger (its head goes into every checkpoint and the Kafka anchor).
    metrics
        Checkpoint timings; ``write_failing`` and readiness while a write fails.
    source
        The event source (``commit``: offsets to the consumer group).
    directory
        ``checkpoint.dir`` (named in an error without a file name).
    dead_letters
        The dead-letter producer, or None.
    anchor_name
        This aggregation's name in the Kafka anchor ("" when it is the only one).
    rng
        ``rng(*tag)``: the generator of a snapshot's layers (None: the OS CSPRNG).
    wait
        ``wait(seconds)``: True when a stop was requested meanwhile.
    """

    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        source,
        directory: Path,
        *,
        dead_letters=None,
        anchor_name: str = "",
        rng: Callable,
        wait: Callable,
    ):
        self.ledger, self.metrics, self.source, self.dir = ledger, metrics, source, directory
        self.dead_letters, self.anchor_name = dead_letters, anchor_name
        self.rng, self.wait = rng, wait

    def commit(self, task: WindowTask, *, snapshot: bool = False, tag: tuple = ()) -> bytes | None:
        """Make ``task``'s position durable (the numbered sequence of the module docstring).
        With ``snapshot``, the checkpoint carries a layered snapshot of the counters, which is
        returned (an audit export reuses it)."""
        if not snapshot and task.window["events"] != (task.replay or {}).get("events", 0):
            # offsets past counted events with no counters would lose them at the next crash
            # (events counted before the window started are replayed: task.replay)
            raise RuntimeError("a checkpoint without a snapshot inside a window")
        # 1. every dead letter of a record before the new offsets is acknowledged
        self.wait_for(self.flush_dead_letters, "dead letters")
        # 2. a fresh layer, the snapshot, a fresh layer: the snapshot is a view of its own
        blob = None
        if snapshot:
            wid = task.window["id"]
            state = task.live_state()
            state.rerandomize(rng=self.rng(2, wid, *tag, 0))
            blob = state.serialize()
            state.rerandomize(rng=self.rng(2, wid, *tag, 1))
        # 3. the checkpoint, atomically, with the ledger's head (an older ledger is refused)
        record = task.record(blob)
        record.ledger_head = self.ledger.head()
        self.wait_for(lambda: self.save(task, record), "checkpoint")
        # 4. offsets to the Kafka group, for lag monitoring, with the ledger's head as anchor
        self.source.commit(record.offsets, self.kafka_anchor())
        return blob

    def save_position(self, task: WindowTask, record) -> None:
        """Steps 1, 3 and 4 of :meth:`commit` for a checkpoint without counters: the dead
        letters before it acknowledged, the record with the ledger's head, the group's offsets."""
        self.wait_for(self.flush_dead_letters, "dead letters")
        record.ledger_head = self.ledger.head()
        self.wait_for(lambda: self.save(task, record), "checkpoint")
        self.source.commit(record.offsets, self.kafka_anchor())

    def save_pending(self, task: WindowTask) -> None:
        """Publishing progress only: the last durable checkpoint with the shorter pending list
        (:meth:`rewrite_pending`; a task without one is committed)."""
        if task.durable is None:
            self.commit(task)
            return
        self.rewrite_pending(task)

    def rewrite_pending(self, task: WindowTask) -> None:
        """Publishing progress only: the task's last durable checkpoint with its shorter pending
        list (the task has one: ``task.durable``)."""
        record = task.rewrite_pending()
        record.ledger_head = self.ledger.head()
        self.wait_for(lambda: self.save(task, record), "checkpoint")

    def kafka_anchor(self) -> str:
        """The ledger's head as the consumer group's commit metadata (:mod:`..anchor`)."""
        return kafka_metadata({self.anchor_name: self.ledger.head()})

    def save(self, task: WindowTask, record) -> None:
        """Write ``record`` to the task's store; it is the task's durable checkpoint now."""
        t0 = time.perf_counter()
        task.checkpoints().save(record)
        task.durable = record
        self.metrics.checkpointed(time.perf_counter() - t0)

    def flush_dead_letters(self) -> None:
        if self.dead_letters is not None:
            self.dead_letters.flush(timeout_s=10.0)

    def wait_for(self, action, what: str) -> None:
        """Run ``action`` until it succeeds (:mod:`.durable_write`: backoff, readiness, a stop
        request ends the wait with :class:`Stopping`)."""
        wait_for_write(action, what, self.metrics, stop=self.wait, directory=self.dir)
