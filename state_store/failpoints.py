"""Failpoints: named instants in the service where a test can make the process die, stop or wait.

Production code marks an instant it must survive a crash at with one call::

    failpoint("checkpoint-after-rename")

and a slow step a test wants slower with ``slow_point("release")``. Unarmed, a failpoint is a
lookup in an empty dict: nothing of a test is imported, read or run. Everything here is inert
unless the process runs with ``PANAGG_TESTING=1`` (the env-armed hooks below) or a test armed a
point in its own process (:func:`armed`); production never arms anything.

Arming a failpoint from a test
------------------------------

*A service run as a child process* (``panagg run`` under ``subprocess``): set in its
environment

``PANAGG_TESTING=1`` and ``PANAGG_TEST_FAULT=POINT[:N[:ACTION]]``
    the N-th time (default 1) the process reaches ``POINT`` it gets SIGKILL (``ACTION`` =
    ``kill``, the default: a crash at that instant, nothing after it runs) or SIGSTOP
    (``stop``: the test changes the world, e.g. stops the broker, then sends SIGCONT).
    Example: ``PANAGG_TEST_FAULT=checkpoint-after-rename:2`` crashes right after the second
    checkpoint became durable.

``PANAGG_TESTING_SHUFFLER_KILL=WHEN``
    the shuffler's kill at ``before_commit`` or ``after_commit`` of a window (its sends
    flushed first); the same as ``PANAGG_TEST_FAULT=shuffler-WHEN``.

``PANAGG_TEST_RELEASE_DELAY_S=SECONDS`` (or ``@FILE``, the seconds read from FILE at each
call, none while it is missing)
    :func:`slow_point` ``("release")`` sleeps that long: every release and every merge of a
    group's leader is that much slower, so a small domain behaves like a large one.

*Code under test in the test's own process*::

    with armed("ledger-before-release", crash):     # crash(point) runs at the 1st passage
        Aggregator(cfg, source).run()

``crash`` is any callable; raising a :class:`BaseException` stops the code at that instant as a
SIGKILL would (no ``except Exception`` of the service catches it). ``armed`` needs no
environment variable and is undone on exit.

The points
----------

``checkpoint-mid-write``, ``checkpoint-before-rename``, ``checkpoint-after-rename`` (a
checkpoint's atomic write, through its ``hook``),
``ledger-before-KIND`` / ``ledger-after-KIND`` (a ledger entry of that kind, e.g. ``release``),
``release-submitted``, ``release-ledgered``, ``published`` (a window's release),
``rollup-before-view``, ``rollup-view-kept``, ``rollup-folded``, ``rollup-ledgered`` (a rollup),
``shuffler-before_commit``, ``shuffler-after_commit`` (the shuffler's window commit).

Why this module is in ``state_store``: the lowest package of the service calls it (the atomic
write), and everything that calls it imports ``state_store`` already; a package of its own would
need every editable install made again, and ``aggregator`` must not be imported by
``state_store``. It imports nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["failpoint", "slow_point", "armed", "is_armed", "under_tests"]

#: point -> [passages so far, the passage it fires at (None: every one), action]: armed in this
#: process by :func:`armed`
_ARMED: dict[str, list] = {}
#: passages of each point counted for PANAGG_TEST_FAULT
_SEEN: dict[str, int] = {}


def under_tests() -> bool:
    """Whether this process runs under the test harness (``PANAGG_TESTING=1``): the switch that
    every env-armed hook and every test-only setting (``settings.py``, ``test_only``) needs."""
    return os.environ.get("PANAGG_TESTING") == "1"


def _from_env(point: str) -> tuple[int, str] | None:
    """(N, action) if the environment arms ``point``, else None."""
    kill_at = os.environ.get("PANAGG_TESTING_SHUFFLER_KILL")
    if kill_at and point == f"shuffler-{kill_at}":
        return 1, "kill"
    spec = os.environ.get("PANAGG_TEST_FAULT")
    if not spec:
        return None
    name, _, rest = spec.partition(":")
    if name != point:
        return None
    nth, _, action = rest.partition(":")
    return int(nth or 1), action or "kill"


def is_armed(point: str) -> bool:
    """Whether ``point`` is armed at all (in this process or by the environment): a caller may
    prepare for the fault first (the shuffler flushes its sends)."""
    return point in _ARMED or (under_tests() and _from_env(point) is not None)


def failpoint(point: str) -> None:
    """Reaching ``point``: nothing, unless a test armed it (the module docstring)."""
    hook = _ARMED.get(point)
    if hook is not None:
        hook[0] += 1
        if hook[1] is None or hook[0] == hook[1]:
            hook[2](point)
        return
    if not os.environ.get("PANAGG_TEST_FAULT") and not os.environ.get(
        "PANAGG_TESTING_SHUFFLER_KILL"
    ):
        return
    armed_here = _from_env(point) if under_tests() else None
    if armed_here is None:
        return
    nth, action = armed_here
    _SEEN[point] = _SEEN.get(point, 0) + 1
    if _SEEN[point] == nth:
        os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)


def slow_point(point: str) -> None:
    """A slow step (``"release"``: a release, or a group leader's merge): sleeps for
    ``PANAGG_TEST_RELEASE_DELAY_S`` under ``PANAGG_TESTING=1``, else returns at once."""
    delay = os.environ.get("PANAGG_TEST_RELEASE_DELAY_S")
    if point != "release" or not delay or not under_tests():
        return
    if delay.startswith("@"):
        try:
            with open(delay[1:]) as f:
                delay = f.read().strip()
        except FileNotFoundError:
            return
    time.sleep(float(delay))


@contextmanager
def armed(point: str, action: Callable[[str], object], nth: int | None = 1) -> Iterator[None]:
    """Arm ``point`` in this process: the ``nth`` time it is reached (``None``: every time)
    ``action(point)`` runs; raise from it to stop there. Disarmed on exit; arming a point twice
    at once is refused (the second would silently replace the first).

    >>> seen = []
    >>> with armed("demo", seen.append, nth=2):
    ...     for _ in range(3):
    ...         failpoint("demo")
    >>> seen, is_armed("demo")
    (['demo'], False)
    """
    if point in _ARMED:
        raise RuntimeError(f"failpoint {point} is armed already")
    _ARMED[point] = [0, nth, action]
    try:
        yield
    finally:
        _ARMED.pop(point, None)
