"""Count windows of a views group: each member cuts its own partitions once the group took N.

One process ends a count window at its N-th event. A views group (``scale.exchange = views``)
has no log the group writes every event to, so no one can place a marker between two events of
the whole group: each member cuts the windows of the source partitions it counts, at its own
position, when the *group's* running total has reached the window's goal.

* Every member reports, about four times a second, each of its partitions' running total of
  events counted since the group began (``t``), its position (``o``) and open window (``w``):
  one record ``progress:<source topic>:<partition>`` in the intake topic, in a transaction of
  the member's transactional id (a member the group dropped is fenced: its reports stop). These
  are the numbers a release states anyway (events in positions, section 16 of docs/privacy.md),
  at a finer grain, never an item or a counter.
* The group's total is the sum of the latest reports of every partition, with the member's own
  partitions counted exactly (:class:`GroupTotals`).
* A member closes its open window once that total reaches the window's goal; the next goal is
  N further on (:func:`next_goal`). The total at a partition's window start and the window's
  goal ride in the offset metadata of the close's transaction, so a restart or a new owner of
  the partition goes on from the committed numbers.

So a window holds N events plus or minus what the members counted while their reports were in
flight (about a poll each); the goals are multiples of N from the start, so the differences do
not add up, except that a member a whole window behind the total starts the next goal from the
total (no window is cut empty to catch up). Exactly once is the views exchange's own: a window
of a partition is what its committed view covers, and the next window starts at that view's
end offset. A forced release closes every member's windows up to the leader's window K, and
the next window counts N from the cut.

>>> totals = GroupTotals("src")
>>> totals.take(progress_key("src", 0), b'{"t": 700, "o": 710, "w": 0}')
True
>>> totals.take(b"close:x", b'{"upto": 3}')
False
>>> totals.total({1: 450})      # partition 1 is this member's: exact
1150
>>> next_goal(1000, 1150, 1000), next_goal(1000, 2300, 1000)
(2000, 3300)
"""

from __future__ import annotations

import json

__all__ = ["GroupTotals", "next_goal", "progress_key", "PROGRESS_S"]

#: how often a member reports its partitions' totals (s): what a cut overshoots N by is about
#: this much of the group's intake, plus a poll
PROGRESS_S = 0.25


def progress_key(source_topic: str, partition: int) -> bytes:
    """The intake topic's key of a source partition's running total."""
    return f"progress:{source_topic}:{int(partition)}".encode()


def next_goal(goal: int, total: int, size: int) -> int:
    """The group total at which the next window closes: ``size`` past this window's goal, or
    past the total now when the group is already that far (a member was away, a backlog)."""
    return goal + size if total < goal + size else total + size


class GroupTotals:
    """The latest reported running total of each source partition of the group."""

    def __init__(self, source_topic: str):
        self.prefix = f"progress:{source_topic}:".encode()
        #: partition -> its running total, as last reported
        self.reported: dict[int, int] = {}

    def take(self, key: bytes | None, value: bytes | None) -> bool:
        """Note a record of the intake topic; True if it was a progress report."""
        if not key or not key.startswith(self.prefix):
            return False
        p = int(key[len(self.prefix) :])
        if value is None:
            self.reported.pop(p, None)
        else:
            self.reported[p] = int(json.loads(value)["t"])
        return True

    def total(self, own: dict[int, int]) -> int:
        """The group's total, with ``own`` (partition -> exact running total) in place of the
        reports of this member's partitions."""
        return sum({**self.reported, **own}.values())
