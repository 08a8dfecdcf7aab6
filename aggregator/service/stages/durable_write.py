"""Waiting for a durable write the loop cannot go on without (a checkpoint, dead letters).

A checkpoint that cannot be written (a full or read-only disk, a broker that does not take the
dead letters) must not be skipped: the offsets after it would say more is durable than is. So
the loop waits for it, retrying with backoff (``..publisher.Backoff``: one log line when the
write starts failing, one when it recovers), and says so while it waits:
``panagg_write_failing{what=...}`` is 1 and ``/ready`` answers 503 with the reason, so a
probe sees the stall at once instead of a process that looks healthy and counts nothing.

A stop request (SIGTERM) ends the wait with :class:`..errors.Stopping`: the write never
happened, nothing after it ran, and the next start resumes from the last durable checkpoint
(the window is replayed, as after a crash). Every mode that checkpoints waits this one way
(the single process and its aggregations through :mod:`.checkpoint`, the shuffle analyzer).

Writes nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..deadletter import DeadLetterError
from ..errors import Stopping
from ..metrics import Metrics
from ..publisher import Backoff

__all__ = ["wait_for_write"]


def wait_for_write(
    action: Callable[[], object],
    what: str,
    metrics: Metrics,
    *,
    stop: Callable[[float], bool],
    directory: Path | None = None,
) -> None:
    """Run ``action`` until it succeeds.

    Parameters
    ----------
    action
        The write (it raises :class:`OSError` or :class:`..deadletter.DeadLetterError` when it
        did not happen).
    what
        Its name in the log, the ``what`` label and the readiness reason ("checkpoint").
    metrics
        Where ``write_failing`` and readiness are set.
    stop
        ``stop(seconds)`` waits up to that long and returns True when a stop was requested
        (``threading.Event.wait`` is one); the wait then ends with :class:`..errors.Stopping`.
    directory
        Named in the reason when the error carries no file name.
    """
    backoff = Backoff(what)
    while True:
        try:
            action()
            if backoff.failing:
                metrics.write_failing.labels(what=what).set(0)
                metrics.set_ready(True)
            backoff.ok()
            return
        except (DeadLetterError, OSError) as exc:
            if isinstance(exc, OSError) and exc.filename is None and directory is not None:
                exc.filename = str(directory)
            if isinstance(exc, DeadLetterError):
                reason = str(exc)
            else:
                where = f": {exc.filename}" if exc.filename is not None else ""
                reason = f"{exc.strerror or type(exc).__name__}{where}"
            backoff.failed(reason)
            # intake waits for this write: health checks must say so at once
            metrics.write_failing.labels(what=what).set(1)
            metrics.set_ready(False, f"{what} cannot be written ({reason}); intake waits for it")
        while not backoff.ready():
            if stop(0.1):
                raise Stopping()
