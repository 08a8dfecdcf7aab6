"""The next window's fresh state, drawn beside the loop while the current window counts.

A window opens with a fresh state: every counter a DLap(p) draw from the OS CSPRNG. At 1e7
counters that draw takes seconds (3.5 s measured on the 2-core machine of docs/e2e.md), and it
ran in the consume loop at every close: the intake stalls of issue 53 (3.1 s at 1e7 counters,
5.4 s with three aggregations), not the hand-off to the release worker. :class:`NextState`
draws window ``w + 1``'s state in a thread as soon as window ``w`` opens (numpy's array work and
``os.urandom`` run without the GIL, so the loop goes on); the close then takes it ready.

Privacy (docs/privacy.md, section 16, "Releases beside the loop: the views"): the drawn state
is noise independent of every event, so an intrusion that reads it during window ``w`` learns
nothing of ``w``'s events, and for window ``w + 1`` it is the memory at that window's start,
which R1's single intrusion already covers. It exists once, in process memory only.

Small states (below ``min_size`` counters) are drawn when asked: the thread would cost more
than the draw. A seeded test generator gives the same state either way (the generator is made
from the window number, not shared).

>>> from aggregator.state import PanPrivateHistogram
>>> made = []
>>> def make(wid):
...     made.append(wid)
...     return PanPrivateHistogram(1.0, size=4)
>>> nxt = NextState(make, size=4, min_size=1)
>>> nxt.take(0).size, nxt.take(1).size, sorted(set(made))
(4, 4, [0, 1, 2])
"""

from __future__ import annotations

import threading
from typing import Callable

__all__ = ["NextState"]

#: from this many counters on the next state is drawn beside the loop (a draw of 1e5 counters
#: takes ~30 ms; below that a thread is not worth it)
MIN_SIZE = 100_000


class NextState:
    """Makes window states with ``make(window_id)``, the next one ahead of time.

    Parameters
    ----------
    make
        Builds the fresh state of a window (thread-safe: it draws new noise, touches nothing
        shared).
    size
        Counters per state; ``min_size``: from which size the next one is drawn ahead.
    """

    def __init__(self, make: Callable[[int], object], *, size: int, min_size: int = MIN_SIZE):
        self.make = make
        self.ahead = int(size) >= int(min_size)
        self._wid: int | None = None
        self._thread: threading.Thread | None = None
        self._ready: object = None
        self._error: BaseException | None = None

    def take(self, window_id: int):
        """The fresh state of ``window_id`` (the one drawn ahead if it is that window's, else
        drawn now), and the next window's draw started."""
        state = None
        if self._thread is not None and self._wid == window_id:
            self._thread.join()
            state, error = self._ready, self._error
            self._thread, self._ready, self._error = None, None, None
            if error is not None:
                raise error
        elif self._thread is not None:  # a window other than the one drawn: drop that draw
            self._thread.join()
            self._thread, self._ready, self._error = None, None, None
        if state is None:
            state = self.make(window_id)
        self._prepare(window_id + 1)
        return state

    def _prepare(self, window_id: int) -> None:
        if not self.ahead:
            return
        self._wid = window_id

        def draw():
            try:
                self._ready = self.make(window_id)
            except BaseException as exc:  # raised in the loop when the state is taken
                self._error = exc

        self._thread = threading.Thread(target=draw, name="panagg-next-state", daemon=True)
        self._thread.start()
