"""The loop's health: what the service says about itself each turn (every mode that runs the
one-process loop wires one).

Each turn of the consume loop ends with :meth:`LoopHealth.turned`: the /healthz heartbeat, the
progress line (once a minute), the reject log's flush and /ready (not ready while the broker is
unreachable or dead letters are not acknowledged). Every 5 s :meth:`LoopHealth.update_lag` reads
the consumer lag and the broker's state, and :meth:`LoopHealth.watch_intake` looks for an intake
stall: a Kafka consumer that holds partitions with records waiting and delivered none for
``source.stall_timeout_s`` is said once, makes /ready 503 and is rebuilt (it resumes at the
service's offsets) until records arrive again. When ``ledger.budget_total`` (or the user unit's
``ledger.budget_per_user``) leaves less than one window's epsilon,
:meth:`LoopHealth.intake_paused` says so (once, then every 10 minutes) and intake pauses.

Invariant: only public-safe numbers go out (event counts, lag, window ids; n is public under
replace-one neighbours): never an item, a counter or a payload. Writes nothing durable.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..ledger import Ledger
from ..metrics import Metrics
from ..rejects import RejectLog

__all__ = ["LoopHealth"]

log = logging.getLogger("panagg.service")


class LoopHealth:
    """Lag, broker state, progress and readiness of one loop over ``source``.

    Parameters
    ----------
    metrics
        The service's metrics (gauges set here).
    source
        The event source (``lag``, and where it has them ``lag_now`` and ``connected``).
    ledger, epsilon
        The privacy ledger and the window's epsilon (the budget pause).
    positions
        The loop's current source positions (a callable: they move every turn).
    reject_log
        Flushed each turn.
    dead_letters
        The dead-letter producer, or None (readiness while its acknowledgements lag).
    user_budget
        The user unit's :class:`..user_budget.UserBudget` (the pause when it cannot pay for a
        window), or None.
    """

    #: seconds between progress lines (a test may set 0: every turn)
    PROGRESS_EVERY_S = 60.0

    def __init__(
        self,
        metrics: Metrics,
        source,
        ledger: Ledger,
        epsilon: float,
        *,
        positions: Callable[[], dict[str, int]],
        reject_log: RejectLog,
        dead_letters=None,
        user_budget=None,
        stall_timeout_s: float = 0.0,
    ):
        self.metrics, self.source, self.ledger, self.epsilon = metrics, source, ledger, epsilon
        self.positions, self.reject_log, self.dead_letters = positions, reject_log, dead_letters
        self.progress_every_s = self.PROGRESS_EVERY_S
        self._last_lag = 0.0
        #: the broker's state at the last look (None: not known, or not a Kafka source)
        self.connected: bool | None = None
        self._pause_logged: float | None = None
        self._progress_at: float | None = None
        self._progress_events = 0.0
        #: the user unit's per-user budget (:mod:`..user_budget`), or None
        self.user_budget = user_budget
        #: ``source.stall_timeout_s`` (0: no stall watch)
        self.stall_timeout_s = float(stall_timeout_s)
        #: since when intake is stalled (monotonic s; None: it is not)
        self.stalled_since: float | None = None

    def update_lag(self, now: bool = False) -> None:
        """Lag and broker state every 5 s (``now``: at once, from the broker's end offsets, for
        a loop that is not polling)."""
        if now:
            probe = getattr(self.source, "lag_now", None)
            lag = probe(self.positions()) if probe else None
            for part, value in (lag or {}).items():
                self.metrics.lag.labels(partition=part).set(value)
            return
        now_t = time.monotonic()
        if now_t - self._last_lag < 5.0:
            return
        self._last_lag = now_t
        probe = getattr(self.source, "connected", None)
        state = probe() if probe else None
        if state is not None:
            if self.connected is not None and state != self.connected:
                log.warning(
                    "Kafka broker %s",
                    "reachable again"
                    if state
                    else "unreachable: counting waits; time windows still close by the clock",
                )
            self.connected = state
            self.metrics.broker_connected.set(int(state))
        lag = self.source.lag(self.positions())
        for part, value in (lag or {}).items():
            self.metrics.lag.labels(partition=part).set(value)
        self.watch_intake()

    def watch_intake(self) -> None:
        """An intake stall (module docstring): said once per stall (no count, no offset in the
        line), /ready 503 meanwhile (:meth:`turned`), each rebuild counted in
        ``panagg_consumer_rebuilds_total``. Only for a source with ``stalled`` and ``rebuild``
        (the Kafka backends, consumers/kafka/common.py); not during a broker outage (reported
        as one) or a budget pause (nothing is polled)."""
        source = self.source
        stalled, rebuild = getattr(source, "stalled", None), getattr(source, "rebuild", None)
        if not self.stall_timeout_s or stalled is None or rebuild is None:
            return
        if self.stalled_since is not None and source.delivered_at > self.stalled_since:
            log.info(
                "Kafka intake resumed: records arrive again (stalled %.0f s)",
                time.monotonic() - self.stalled_since,
            )
            self.stalled_since = None
        if self.connected is False or self._pause_logged is not None:
            return
        if not stalled(self.positions(), self.stall_timeout_s):
            return
        now = time.monotonic()
        if self.stalled_since is None:
            self.stalled_since = now
            log.warning(
                "Kafka intake stalled: the consumer holds partitions with records "
                "waiting but delivered none for %g s (source.stall_timeout_s); "
                "rebuilding it; the new one resumes at the counted offsets (nothing "
                "is lost or counted twice)",
                self.stall_timeout_s,
            )
        self.metrics.consumer_rebuilds.inc()
        self.metrics.set_ready(False, "Kafka intake stalled: rebuilding the consumer")
        rebuild()

    def budget_exhausted(self) -> str | None:
        """The line to pause intake with, when ``ledger.budget_total`` (or, under the user unit,
        ``ledger.budget_per_user``) leaves less than one window's epsilon: counting on would
        only fill windows that are refused and discarded."""
        per_user = self.user_budget.exhausted() if self.user_budget is not None else None
        if per_user is not None:
            # (the gauges follow the start and each release; this refreshes them while paused)
            self.metrics.user_budget(self.user_budget)
            return per_user
        remaining = self.ledger.remaining()
        if remaining is None or remaining >= self.epsilon * (1 - 1e-12):
            return None
        return (
            f"privacy budget spent: {self.ledger.spent():g} of ledger.budget_total="
            f"{self.ledger.budget_total:g} leaves {remaining:g} < {self.epsilon:g} for a "
            "window, so intake is paused (nothing is consumed, no window is counted only to "
            "be discarded). Fix: raise ledger.budget_total (a policy change, recorded in the "
            "ledger with --accept-change) or stop the service"
        )

    def intake_paused(self, finite: bool) -> bool:
        """True while intake is paused for the budget (said once, then every 10 minutes; not
        ready meanwhile). Only an endless source (Kafka) pauses: a finite run (a file, the
        generator) goes to its end, and each window the budget cannot pay for is refused,
        ledgered and logged."""
        if finite:
            return False
        problem = self.budget_exhausted()
        self.metrics.intake_paused.set(1 if problem else 0)
        if problem is None:
            self._pause_logged = None
            return False
        now = time.monotonic()
        if self._pause_logged is None or now - self._pause_logged >= 600.0:
            log.error("%s", problem)  # once, then every 10 minutes while paused
            self._pause_logged = now
        self.metrics.heartbeat()
        self.metrics.set_ready(False, "privacy budget spent: intake paused")
        return True

    def progress_line(self) -> None:
        """One info line a minute: events counted, rate, open window(s), lag (public numbers)."""
        now = time.monotonic()
        last = self._progress_at
        if last is None:
            self._progress_at, self._progress_events = now, self.metrics.events._value.get()
            return
        if now - last < self.progress_every_s:
            return
        events = self.metrics.events._value.get()
        rate = (events - self._progress_events) / (now - last)
        self._progress_at, self._progress_events = now, events
        lag = sum(s.value for m in self.metrics.lag.collect() for s in m.samples)
        log.info(
            "progress: %s events counted (%.0f/s over the last %.0f s), window %s at %s "
            "events, lag %s records",
            f"{int(events):,}",
            rate,
            now - last,
            int(self.metrics.window_id._value.get()),
            f"{int(self.metrics.window_events._value.get()):,}",
            f"{int(lag):,}",
        )

    def turned(self) -> None:
        """One turn of the consume loop is done: /healthz and /ready (docs/operations.md)."""
        self.metrics.heartbeat()
        self.progress_line()
        self.reject_log.flush()
        if self.connected is False:
            self.metrics.set_ready(False, "Kafka broker unreachable")
        elif self.stalled_since is not None:
            self.metrics.set_ready(
                False,
                "Kafka intake stalled: records wait in assigned "
                "partitions and none arrive; the consumer is being rebuilt",
            )
        elif self.dead_letters is not None and self.dead_letters.outstanding > 10_000:
            self.metrics.set_ready(False, "dead letters are not being acknowledged")
        else:
            self.metrics.set_ready(True)
