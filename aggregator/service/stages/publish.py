"""Publishing a task's ledgered releases, and the ledger's head beside them.

A release reaches ``task.pending`` once the ledger holds its document. :meth:`PublishStep.
publish_pending` hands the pending documents to the :class:`..publisher.ReleasePublisher`
(files in ``release.dir`` at once, the release topic retried on its own, in window order); each
document every sink holds leaves ``task.pending``, the shorter list is checkpointed
(``save_pending``), and the ledger's head is recorded beside the releases (:mod:`..anchor`), so
that a state directory restored without its latest ledger is refused at the next start.
At the end of a run :meth:`PublishStep.publish_last` tries once more and refuses to end quietly
with releases undelivered (they stay in the checkpoint for the next start).

Invariant: only ledgered documents are published, in window order. Durable writes: the release
files (noised documents), the release topic's records, the release directory's anchor file
(a ledger head: a sequence number and a hash, no data).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from state_store.failpoints import failpoint
from state_store.registry import ledger_id

from ..anchor import write_release_dir_anchor
from ..errors import ServiceError
from ..ledger import Ledger
from ..metrics import Metrics
from ..publisher import ReleasePublisher
from ..window import WindowTask

__all__ = ["PublishStep", "release_key"]

log = logging.getLogger("panagg.service")


def release_key(release: dict) -> str:
    """A release's Kafka record key: its window, after its aggregation's name if it has one."""
    key = str(release["window"])
    if release.get("aggregation"):
        key = f"{release['aggregation']['name']}/{key}"
    return key


class PublishStep:
    """Delivers one aggregation's ledgered releases.

    Parameters
    ----------
    release_dir, topic
        ``release.dir`` and ``release.topic`` ("" for files only).
    ledger
        The privacy ledger (its head is anchored in ``release_dir``).
    metrics
        Releases published, the last release's time, the release's public figures.
    producer
        A callable returning the Kafka producer (made on first use).
    save_pending
        ``save_pending(task)``: checkpoints the task's shorter pending list.
    """

    def __init__(
        self,
        release_dir,
        topic: str,
        ledger: Ledger,
        metrics: Metrics,
        *,
        producer: Callable,
        save_pending: Callable[[WindowTask], None],
        plot: bool = True,
    ):
        self.release_dir, self.ledger, self.metrics = release_dir, ledger, metrics
        self.save_pending = save_pending
        self.publisher = ReleasePublisher(
            release_dir,
            topic,
            producer=producer,
            key_of=release_key,
            on_published=self.published,
            plot=plot,
        )

    def publish_pending(self, task: WindowTask) -> None:
        """Deliver the ledgered releases of ``task.pending`` (:mod:`..publisher`): files at
        once, the release topic retried on its own; each leaves the checkpoint once every sink
        has it."""
        if not task.pending or not self.publisher.due():
            return
        done = self.publisher.publish(list(task.pending))
        for doc in done:
            failpoint("published")
            task.pending.remove(doc)
        if done:
            self.save_pending(task)
            self.anchor_in_release_dir()

    def publish_last(self, task: WindowTask) -> None:
        """The run's end: retry the sinks now; a run must not end looking successful if it
        could not publish (:class:`..errors.ServiceError`)."""
        if task.pending:
            self.publisher.retry_now(wait_s=10.0)
            self.publish_pending(task)
        if task.pending:
            raise ServiceError(
                f"{len(task.pending)} release(s) could not be published "
                f"({self.publisher.last_reason}); they stay in the checkpoint and are "
                "published at the next start once the cause is fixed"
            )

    def published(self, release: dict, path: Path) -> None:
        """A release's file is written: metrics and the log line."""
        self.metrics.releases.inc()
        self.metrics.last_release.set(time.time())
        self.metrics.published(release)
        log.info(
            "published release of window %s: n=%s -> %s", release["window"], release["n"], path
        )

    def anchor_in_release_dir(self) -> None:
        """The ledger's head beside the published releases (:mod:`..anchor`); best effort: a
        failure is said once and retried at the next publication."""
        try:
            write_release_dir_anchor(
                self.release_dir,
                self.ledger.path,
                self.ledger.head(),
                ledger_id(self.ledger.entries),
            )
        except OSError as exc:
            log.warning(
                "could not record the ledger's head in %s (%s); retried at the next publication",
                self.release_dir,
                exc.strerror or exc,
            )
