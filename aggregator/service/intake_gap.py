"""How long intake stops: the longest time the consume loop spends between two polls.

While the loop counts a poll's records, closes a window, hands it to the release worker or
writes a checkpoint, nothing is read from the source: records wait in Kafka. The gap from the
end of one poll to the start of the next is that time (a poll that waits for records is not a
stall: there is nothing to read). :class:`IntakeGap` keeps the longest gap of the current
window; at a window's close the service exports it as ``panagg_intake_stall_seconds``, the
figure operators alert on and the benches report (docs/operations.md).

>>> t = [0.0]
>>> gap = IntakeGap(clock=lambda: t[0])
>>> gap.polled(); t[0] = 0.3; gap.polling()     # 0.3 s of counting
>>> gap.polled(); t[0] = 2.3                     # a close that takes 2 s ...
>>> gap.take()                                   # ... is the closed window's stall so far
2.0
>>> gap.polling(); gap.take()                    # and its rest counts in the next window
0.0
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["IntakeGap"]


class IntakeGap:
    """The longest gap between two polls since the last :meth:`take`.

    Parameters
    ----------
    clock
        Seconds, monotonic (``time.monotonic``; a test passes its own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._since: float | None = None  # end of the last poll; None while polling
        self._longest = 0.0

    def polled(self) -> None:
        """A poll returned: the loop is busy from now until the next :meth:`polling`."""
        self._since = self.clock()

    def polling(self) -> None:
        """A poll starts: the gap since :meth:`polled` ends here."""
        if self._since is not None:
            self._longest = max(self._longest, self.clock() - self._since)
            self._since = None

    def take(self) -> float:
        """The longest gap since the last call (a gap still open counts up to now; its rest
        counts again after this call), and start over."""
        now = self.clock()
        longest = self._longest
        if self._since is not None:
            longest = max(longest, now - self._since)
            self._since = now
        self._longest = 0.0
        return round(longest, 6)
