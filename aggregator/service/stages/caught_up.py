"""Whether intake has read what the source holds now: the idle exit and the offline catch-up.

Two callers ask it. ``--exit-when-idle`` ends a run after a stretch of empty polls, but an empty
poll is not an idle stream while the consumer group has not assigned this process partitions
yet, or while it has not read them to their end (a rebalance, a slow first fetch):
:func:`idle_can_count`, which :class:`IdleExit` asks before it counts a stretch as idle. Offline
commands that act on the open window of a stopped service (``panagg release`` / ``panagg
export`` without a running service) first replay that window from the source, and anything
newer, then stop: :func:`catch_up`.

Partitions intake holds at a later event-time window's start (:attr:`.intake.Intake.held`) are
waiting, not behind: neither caller waits for them. File and generator sources have no
assignment: they are caught up when they say so (``exhausted``) or when a poll is empty.

Durable writes: none here (a catch-up counts into memory; its snapshots are ``snapshot``'s).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from consumers.base import Segment

from ..errors import ServiceError

__all__ = ["IdleExit", "catch_up", "idle_can_count"]


def idle_can_count(source, held: set[str]) -> bool:
    """Whether a turn without records counts towards --exit-when-idle: not before the
    consumer group has assigned this process partitions and it has read them to their end
    (a rebalance or a slow first fetch is not an idle stream)."""
    assigned = getattr(source, "assigned", None)
    if assigned is None:  # file and generator sources
        return True
    if not assigned:
        return False
    probe = getattr(source, "caught_up", None)
    # partitions waiting at a later event-time window are held there, not behind
    return (
        probe is None or bool(probe(sorted(set(assigned) - set(held))))
        if set(assigned) - set(held)
        else True
    )


class IdleExit:
    """``--exit-when-idle``: ends a run after ``idle_exit_s`` of polls without records, counted
    only while ``can_count()`` (:func:`idle_can_count`); None: never."""

    def __init__(self, idle_exit_s: float | None, can_count: Callable[[], bool]):
        self.after_s, self.can_count = idle_exit_s, can_count
        self.since: float | None = None

    def polled(self) -> None:
        """A poll brought records: the idle stretch starts again."""
        self.since = None

    def over(self, paused: bool = False) -> bool:
        """After a poll without records (``paused``: a turn the spent budget paused intake):
        whether the run has been idle long enough to end. Nothing is counted while paused (the
        source is not read), so a pause is an idle stretch whatever the source holds."""
        # only an --exit-when-idle run asks (the check may wait on the broker)
        if self.after_s is None or not (paused or self.can_count()):
            return False
        self.since = self.since or time.monotonic()
        return time.monotonic() - self.since >= self.after_s


def catch_up(
    source,
    held: Callable[[], set[str]],
    *,
    ingest: Callable[[Segment], None],
    snapshot: Callable[[], None],
    bootstrap: str,
    timeout_s: float = 120.0,
) -> None:
    """Count what ``source`` holds now (the open window's replay, then anything newer) with
    ``ingest``, taking the live loop's snapshots (``snapshot``) on the way; ``held()``: the
    partitions intake holds. Raises :class:`..errors.ServiceError` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        segments = source.poll(0.5)
        for seg in segments:
            ingest(seg)
        snapshot()  # the same public schedule as the live loop
        if segments:
            continue
        if source.exhausted:
            return
        probe = getattr(source, "caught_up", None)
        now_held = held()
        assigned = sorted(set(getattr(source, "assigned", ()) or ()) - now_held)
        if probe is None or (assigned and probe(assigned)) or (now_held and not assigned):
            return  # (partitions held at a later event-time window are not behind)
        if time.monotonic() > deadline:
            raise ServiceError(
                f"could not replay the open window from the source within "
                f"{timeout_s:.0f} s; is the broker at "
                f"{bootstrap} reachable?"
            )
