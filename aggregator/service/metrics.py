"""Prometheus metrics of the service (prometheus-client), bound to 127.0.0.1 by default.

Everything exported is public-safe: event counts (n is public under replace-one neighbors),
decode errors by reason, release/checkpoint timings, window progress, consumer lag per partition
and the privacy budget spent. Never a per-item or per-counter value, never a payload.
"""

from __future__ import annotations

import platform
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)

from consumers.decode import REASONS

from ..changes import STATISTICS, compare

__all__ = ["Metrics"]


def panagg_version() -> str:
    """The installed package's version ("unknown" from a source tree that is not installed)."""
    try:
        return version("panagg")
    except PackageNotFoundError:
        return "unknown"


disable_created_metrics()  # *_created series only add noise to dashboards

_SECONDS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.events = Counter("panagg_events", "Events counted into the state", registry=r)
        self.decode_errors = Counter(
            "panagg_decode_errors", "Messages rejected, by reason", ["reason"], registry=r
        )
        for reason in REASONS:
            self.decode_errors.labels(reason=reason)
        self.filtered = Counter(
            "panagg_filtered_records",
            "Records item.filter left out (not events, not rejects)",
            registry=r,
        )
        self.dead_letters = Counter(
            "panagg_dead_letters", "Rejected messages sent to the dead-letter topic", registry=r
        )
        self.releases = Counter("panagg_releases", "Window releases published", registry=r)
        self.releases_refused = Counter(
            "panagg_releases_refused",
            "Releases refused by the privacy ledger (over budget)",
            registry=r,
        )
        self.exports = Counter("panagg_audit_exports", "Signed audit exports written", registry=r)
        self.last_release = Gauge(
            "panagg_last_release_timestamp_seconds",
            "Unix time of the last published release",
            registry=r,
        )
        self.release_duration = Histogram(
            "panagg_release_duration_seconds",
            "Time to estimate and publish a release",
            buckets=_SECONDS,
            registry=r,
        )
        self.write_failing = Gauge(
            "panagg_write_failing",
            "1 while a durable write the loop "
            "waits for keeps failing (intake stops until it succeeds)",
            ["what"],
            registry=r,
        )
        for what in ("checkpoint", "dead letters"):
            self.write_failing.labels(what=what).set(0)
        self.checkpoint_duration = Histogram(
            "panagg_checkpoint_duration_seconds",
            "Time to write a checkpoint durably",
            buckets=_SECONDS,
            registry=r,
        )
        self._last_checkpoint = time.time()
        self.checkpoint_age = Gauge(
            "panagg_checkpoint_age_seconds", "Seconds since the last durable checkpoint", registry=r
        )
        self.checkpoint_age.set_function(lambda: time.time() - self._last_checkpoint)
        self.window_id = Gauge("panagg_window_id", "Index of the current window", registry=r)
        self.window_events = Gauge(
            "panagg_window_events", "Events counted in the current window", registry=r
        )
        self.window_progress = Gauge(
            "panagg_window_progress_ratio",
            "Fraction of the current window done (events or time)",
            registry=r,
        )
        self.lag = Gauge(
            "panagg_consumer_lag_records",
            "Records behind the partition end",
            ["partition"],
            registry=r,
        )
        self.broker_connected = Gauge(
            "panagg_broker_connected",
            "1 while the Kafka client "
            "holds a ready broker connection, 0 during an outage "
            "(NaN until known, and for file and generator sources)",
            registry=r,
        )
        self.broker_connected.set(float("nan"))
        self.consumer_rebuilds = Counter(
            "panagg_consumer_rebuilds",
            "Kafka consumers replaced "
            "because they delivered nothing for "
            "source.stall_timeout_s while their partitions had "
            "records waiting (an intake stall)",
            registry=r,
        )
        self.budget_spent = Gauge(
            "panagg_budget_spent_epsilon", "Epsilon spent by all ledgered releases", registry=r
        )
        self.budget_remaining = Gauge(
            "panagg_budget_remaining_epsilon",
            "Epsilon left under "
            "ledger.budget_total (+Inf: no total cap); below "
            "panagg_epsilon, intake is paused",
            registry=r,
        )
        self.budget_remaining.set(float("inf"))
        # under state.privacy_unit = "user": what every user has been charged (each user-level
        # release charges every user, present or not, so these depend on no event)
        self.user_budget_spent = Gauge(
            "panagg_user_budget_spent_epsilon",
            "Epsilon charged to "
            "every user by user-level releases (this ledger and the "
            "budget registry's other deployments; 0 under the event "
            "unit)",
            registry=r,
        )
        self.user_budget_remaining = Gauge(
            "panagg_user_budget_remaining_epsilon",
            "Epsilon "
            "left to every user under ledger.budget_per_user "
            "(+Inf under the event unit); below panagg_epsilon, "
            "intake is paused",
            registry=r,
        )
        self.user_budget_remaining.set(float("inf"))
        self.intake_paused = Gauge(
            "panagg_intake_paused",
            "1 while the service consumes nothing because the privacy budget is spent",
            registry=r,
        )
        self.intake_stall = Gauge(
            "panagg_intake_stall_seconds",
            "Longest time the consume "
            "loop spent between two polls in the last closed window "
            "(counting, closing, handing off; a poll waiting for records "
            "is not a stall)",
            registry=r,
        )
        # the latest published release's statistics (released values, already private), so a
        # dashboard can trend them across windows
        self.release_window = Gauge(
            "panagg_release_window", "Window number of the latest published release", registry=r
        )
        self.release_distinct = Gauge(
            "panagg_release_distinct_items",
            "Distinct items in the latest published release",
            registry=r,
        )
        self.release_entropy = Gauge(
            "panagg_release_entropy_nats",
            "Entropy (nats) in the latest published release",
            registry=r,
        )
        self.release_snr = Gauge(
            "panagg_release_signal_to_noise",
            "Signal-to-noise of the latest "
            "published release: its distinct items over their expected "
            "error (10: about +-10%)",
            registry=r,
        )
        # +1 / -1: the statistic rose / fell significantly (level 0.9, aggregator.changes) since
        # the previous release this process published; 0: no significant change; NaN: unknown
        self.release_change = Gauge(
            "panagg_release_change",
            "Significant change of a released "
            "statistic since the previous release (level 0.9): 1 rise, "
            "-1 fall, 0 none",
            ["statistic"],
            registry=r,
        )
        self._last_release: dict | None = None
        for g in (
            self.release_window,
            self.release_distinct,
            self.release_entropy,
            self.release_snr,
            *(self.release_change.labels(statistic=s) for s in ("distinct_items", "entropy_nats")),
        ):
            g.set(float("nan"))
        self.build_info = Gauge(
            "panagg_build_info",
            "Always 1; the labels say which panagg and Python run",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(version=panagg_version(), python=platform.python_version()).set(1)
        self.epsilon = Gauge("panagg_epsilon", "Configured epsilon of each window", registry=r)
        # scale-out (scale.partitioned): per-process view of the partitions it owns
        self.partitions_owned = Gauge(
            "panagg_partitions_owned", "Kafka partitions whose state this process holds", registry=r
        )
        self.handovers = Counter(
            "panagg_partition_handovers",
            "Partition states taken over (acquired) or handed over (released)",
            ["event"],
            registry=r,
        )
        for event in ("acquired", "released"):
            self.handovers.labels(event=event)
        self.summaries = Counter(
            "panagg_partition_summaries",
            "Per-partition window summaries written for the merge",
            registry=r,
        )
        self.windows_waiting = Gauge(
            "panagg_windows_waiting",
            "Closed windows still waiting for summaries of some partitions",
            registry=r,
        )
        self.summaries_overdue = Gauge(
            "panagg_summaries_overdue",
            "Scale-out leader: partitions "
            "whose summary of the next window is more than 5 s late "
            "(their member is stopped, stuck or gone)",
            registry=r,
        )
        self.release_queue = Gauge(
            "panagg_release_queue",
            "Closed windows waiting for their release (in the release worker)",
            registry=r,
        )
        self.release_latency = Histogram(
            "panagg_release_latency_seconds",
            "From the end of a "
            "window to its release being ledgered (scale-out: its "
            "merged release published)",
            buckets=_SECONDS,
            registry=r,
        )
        self.registry_check = Histogram(
            "panagg_registry_check_seconds",
            "Time to read the "
            "budget registry to its end and check one window's "
            "charges against it (once per release, before its "
            "noise is drawn; never on the counting path)",
            buckets=_SECONDS,
            registry=r,
        )
        # window.rollups: per span (label), released values only
        self.rollups = Counter(
            "panagg_rollups_released",
            "Rollups ledgered (summed from the base windows' release views, 0 extra eps)",
            ["span"],
            registry=r,
        )
        self.rollup_distinct = Gauge(
            "panagg_rollup_distinct_items",
            "Distinct items in the last published rollup of each span",
            ["span"],
            registry=r,
        )
        self.rollup_entropy = Gauge(
            "panagg_rollup_entropy_nats",
            "Entropy (nats) in the last published rollup of each span",
            ["span"],
            registry=r,
        )
        self.rollup_windows = Gauge(
            "panagg_rollup_windows",
            "Base windows in the last rollup of "
            "each span (fewer than its span: some are missing, the "
            "release says which)",
            ["span"],
            registry=r,
        )
        self.rollup_seconds = Gauge(
            "panagg_rollup_release_seconds",
            "Estimate time of the last rollup of each span",
            ["span"],
            registry=r,
        )
        self._server = None
        self._heartbeat: float | None = None
        self._ready: tuple[bool, str] = (False, "starting")
        # /ready as a series, for alerting (deploy/prometheus/alerts.yml); the reason is in /ready
        self.ready = Gauge(
            "panagg_ready",
            "1 while /ready answers 200 (counting), 0 while it "
            "answers 503 (starting, broker unreachable, a write failing, budget "
            "spent, a group leader behind: /ready says which)",
            registry=r,
        )
        self.ready.set_function(lambda: 1.0 if self._ready[0] else 0.0)

    def budget(self, spent: float, remaining: float | None, user=None) -> None:
        """The budget gauges: ``ledger.budget_total``'s, and ``user``'s (the user unit's
        :class:`.user_budget.UserBudget`) when there is one."""
        self.budget_spent.set(spent)
        self.budget_remaining.set(float("inf") if remaining is None else remaining)
        if user is not None:
            self.user_budget(user)

    def user_budget(self, user) -> None:
        """``ledger.budget_per_user``'s gauges from the user unit's ``UserBudget``."""
        spent = user.spent()
        self.user_budget_spent.set(spent)
        self.user_budget_remaining.set(max(user.budget - spent, 0.0))

    def rollup_released(self, span: str, release: dict) -> None:
        """A rollup is ledgered: its count, its base windows and its estimate time."""
        self.rollups.labels(span=span).inc()
        self.rollup_windows.labels(span=span).set(len(release["rollup"]["windows"]))
        self.rollup_seconds.labels(span=span).set(release.get("release_seconds", float("nan")))

    def published(self, release: dict) -> None:
        """Gauges of a published release's statistics (released values only); a rollup's go to
        the rollup gauges of its span (the window gauges stay the base windows')."""
        props = release.get("properties") or {}
        if release.get("rollup"):
            span = release["rollup"]["span"]
            self.rollup_distinct.labels(span=span).set(props.get("distinct_items", float("nan")))
            self.rollup_entropy.labels(span=span).set(props.get("entropy_nats", float("nan")))
            return
        if isinstance(release.get("window"), int):
            self.release_window.set(release["window"])
        self.release_distinct.set(props.get("distinct_items", float("nan")))
        self.release_entropy.set(props.get("entropy_nats", float("nan")))
        snr = (release.get("accuracy") or {}).get("signal_to_noise")
        self.release_snr.set(float("nan") if snr is None else snr)
        c = compare(self._last_release, release) if self._last_release else {}
        for stat in STATISTICS:
            d = (c.get(stat) or {}).get("direction")
            self.release_change.labels(statistic=stat).set(float("nan") if d is None else d)
        self._last_release = release

    def checkpointed(self, seconds: float) -> None:
        self.checkpoint_duration.observe(seconds)
        self._last_checkpoint = time.time()

    # -- health: /healthz (the loop turns) and /ready (counting), next to /metrics --------------
    def heartbeat(self) -> None:
        """The consume loop finished a turn (called once per turn)."""
        self._heartbeat = time.monotonic()

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready = (bool(ready), reason)

    def health(self, stale_s: float = 60.0) -> tuple[int, str]:
        age = time.monotonic() - self._heartbeat if self._heartbeat else None
        if age is None:
            return 503, "starting: the consume loop has not turned yet\n"
        if age > stale_s:
            return 503, f"stuck: no turn of the consume loop for {age:.0f} s\n"
        return 200, "ok\n"

    def readiness(self) -> tuple[int, str]:
        ready, reason = self._ready
        return (200, "ready\n") if ready else (503, f"not ready: {reason}\n")

    def serve(self, host: str = "127.0.0.1", port: int = 9464) -> int:
        """Serve /metrics (Prometheus exposition), /healthz and /ready; returns the bound port
        (0 picks a free one)."""

        exposition = make_wsgi_app(self.registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "")
            if path in ("/healthz", "/ready"):
                code, body = self.health() if path == "/healthz" else self.readiness()
                start_response(
                    f"{code} {'OK' if code == 200 else 'Service Unavailable'}",
                    [("Content-Type", "text/plain; charset=utf-8")],
                )
                return [body.encode()]
            return exposition(environ, start_response)

        class _Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True

        class _Quiet(WSGIRequestHandler):
            def log_message(self, *args):  # scrapes are not log lines
                pass

        server = make_server(host, port, app, server_class=_Server, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="panagg-metrics", daemon=True).start()
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
