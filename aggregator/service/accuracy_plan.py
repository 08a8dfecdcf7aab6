"""What a service says about accuracy before and at each release: the start line's plan
(:func:`accuracy_plan`: the error floor of the configured counters, eps and layers, and the
expected errors of simulated releases, :func:`planned_errors`) and the error line for a release
below its noise (:func:`warn_if_below_noise`). Public quantities only: nothing of the stream."""

from __future__ import annotations

import logging
import math
import threading
import time

from ..intervals import SNR_MIN, noise_floor
from ..largedomain import choose_buckets
from ..noise import p_from_epsilon
from ..release import (
    PLAN_MAX_EVENTS,
    PLAN_SHAPES,
    PlanCancelled,
    planned_accuracy,
    privacy_unit_clause,
)
from ..state import NEIGHBOR_RELATIONS
from .identity import choose_buckets_for
from .settings import Config
from .user_window import is_user, user_plan_line

__all__ = [
    "accuracy_plan",
    "planned_errors",
    "warn_if_below_noise",
    "below_noise_fix",
    "StartPlan",
    "expected_release_seconds",
    "release_time_warning",
]

log = logging.getLogger("panagg.service")


def warn_if_below_noise(release: dict) -> None:
    """One error line for a release whose signal is below its noise (the document says so too,
    in ``signal_below_noise``): it may look normal and still be mostly noise.

    The line names one figure signal-to-noise: the release's own ``accuracy.signal_to_noise``
    (the distinct-items estimate over its expected error); the public events-over-the-noise-floor
    figure is named as such. The fix it suggests is one the release's configuration does not
    already have (hashed mode is not suggested to a hashed-mode release)."""
    acc = release.get("accuracy") or {}
    if not acc.get("signal_below_noise"):
        return
    snr = acc.get("signal_to_noise")
    # (events over the Cramer-Rao floor; older releases held it under signal_to_noise)
    over = acc.get("events_over_noise_floor", snr if snr is not None else 0.0) or 0.0
    why = (
        "its distinct items could be off by 2x at the interval's level"
        if acc.get("distinct_could_be_off_2x")
        else f"events over the noise floor below {SNR_MIN:g}"
    )
    n = release.get("n") if release.get("n") is not None else release.get("n_in_histogram")
    floor = acc.get("noise_floor_items")
    log.error(
        "window %s: the release is below its noise floor (%s; signal-to-noise %s, events "
        "over the noise floor %.2f: %s events against an error floor of ~%s items); its "
        "statistics are mostly noise. Fix: %s",
        release.get("window"),
        why,
        "?" if snr is None else f"{snr:.1f}",
        over,
        "?" if n is None else f"{n:,}",
        f"{floor:,.0f}" if floor else "?",
        below_noise_fix(release),
    )


def below_noise_fix(release: dict) -> str:
    """What helps a release below its noise, for the mode it was made in: more events per
    window, a larger eps, fewer counters; hashed mode only to a direct-mode release."""
    domain = release.get("domain") or {}
    if domain.get("mode") == "hashed":
        size = domain.get("size")
        fewer = (
            f"fewer buckets (state.buckets, {size:,} now) when items repeat"
            if isinstance(size, int)
            else "fewer buckets (state.buckets) when items repeat"
        )
        return (
            "more events per window (window.size, and state.expected_n with it), "
            f"a larger state.epsilon, or {fewer}"
        )
    return (
        "more events per window (window.size), fewer counters "
        '(state.domain_size, or hashed mode: state.mode = "hashed"), or a larger '
        "state.epsilon"
    )


def accuracy_plan(cfg: Config, simulate: bool = True) -> tuple[str, bool]:
    """The start line on accuracy: the error floor for the configured counters, eps, layers and
    the events a window is expected to hold, and a suggestion when that is below the noise.

    Public quantities only (nothing of the stream): the number of counters (D, or B in hashed
    mode), p, the layers the release will carry (1, plus 2 per in-window snapshot, plus the
    joint model's release layer) and n (count windows: their size; time windows and hashed
    mode: ``state.expected_n``). With ``simulate``, the line ends with the expected errors the
    releases will state (:func:`planned_errors`, seconds). Returns (line, below_noise).
    """

    if is_user(cfg):  # distinct users from a density state: its own plan (no simulation)
        return user_plan_line(cfg), False
    st = cfg.state
    counters, p, layers, n, hashed = _plan_inputs(cfg)
    floor = noise_floor(counters, p, layers)
    basis = "the window's size" if cfg.window.kind == "count" else "state.expected_n"
    n_min = int(math.ceil(SNR_MIN * floor))
    line = (
        f"accuracy plan: {counters:,} counters ({'B' if hashed else 'D'}), eps {st.epsilon:g}"
        f", {layers} noise layer(s) at release: error floor ~{floor:,.0f} items; with "
        f"{n:,} events per window ({basis}) events over the noise floor {n / floor:.1f}; "
        f"windows need >= {n_min:,} events to be above the noise; {privacy_unit_clause()}"
    )
    slow = release_time_warning(cfg)
    if slow:
        line += "; " + slow
    if simulate:
        line += _planned_errors(counters, p, layers, n, hashed)
    below = n / floor < SNR_MIN
    if below:
        b = choose_buckets(max(n, 2), float(st.epsilon))
        line += (
            f'. BELOW THE NOISE at {n:,} events: use hashed mode (state.mode = "hashed", '
            f"~{b:,} buckets for {n:,} events)"
            if not hashed
            else f". BELOW THE NOISE at {n:,} events: set state.buckets (~{b:,})"
        )
        line += " or longer windows (window.size)"
    return line, below


#: A release's time on this 2-core machine, linear in its counters (D, or B in hashed mode):
#: :func:`aggregator.release.make_release` of one window (joint model, 2 layers, Zipf(1.1) items,
#: n = min(D, 1e6) events), each size in a fresh process, the first (cold) run timed as a
#: service's first release is: with the default estimator (auto) and 10 bootstrap repetitions
#: 2.5 s at D = 1e4, 2.8 s at 1e5, 2.9 s at 1e6, 3.0 s at 3e6 (1.8 s warm) and 3.8 s at 1e7 (3.4
#: s warm); hashed, B = 2e5 / 2e6: 4.0 / 3.3 s. Fit, rounded up: 3 s + 2.5e-7 s per counter.
#: With a fast estimator (threshold, deconvolution) and no bootstrap (error_bar_reps = 0):
#: 0.01 s at 1e4, 0.35-0.46 s at 3e6, 1.4-1.5 s at 1e7: 0.05 s + 1.5e-7 s per counter.
#: Measured on an idle machine: under load (other processes, several aggregations sharing
#: release.workers) a hashed release of a 60 s window took 36-72 s (issue 51), where this says
#: ~3 s; so the estimate is a lower bound, and a window near it is already short.
RELEASE_SECONDS = {"default": (3.0, 2.5e-7), "fast": (0.05, 1.5e-7)}
FAST_ESTIMATORS = ("threshold", "deconvolution")


def _fast_release(cfg: Config) -> tuple[bool, bool]:
    """(the estimator is a fast one, the bootstrap is off) for this configuration."""
    return (cfg.release.estimator in FAST_ESTIMATORS, int(cfg.release.error_bar_reps) == 0)


def expected_release_seconds(cfg: Config) -> float:
    """About how long one release of this configuration takes on an idle 2-core machine
    (:data:`RELEASE_SECONDS`: a line in the counters, measured): the fast line when the
    estimator is fast and the bootstrap off, else the default's."""
    counters = _plan_inputs(cfg)[0]
    base, per_counter = RELEASE_SECONDS["fast" if all(_fast_release(cfg)) else "default"]
    return base + per_counter * counters


def release_time_warning(cfg: Config) -> str | None:
    """For time windows (``time``, ``event_time``) shorter than a release is expected to take
    (:func:`expected_release_seconds`): a clause saying so and naming the settings that fix it
    (the ones not already set); None otherwise (count windows: their length in seconds is not
    known before the data)."""
    if cfg.window.kind == "count" or cfg.state.privacy_unit == "user":
        return None
    seconds = expected_release_seconds(cfg)
    if seconds <= float(cfg.window.size):
        return None
    counters, hashed = _plan_inputs(cfg)[0], cfg.state.mode == "hashed"
    fixes = [f"longer windows (window.size >= {math.ceil(seconds):,} s)"]
    fast_estimator, no_bootstrap = _fast_release(cfg)
    if not fast_estimator:
        fixes.append('a faster estimator (release.estimator = "deconvolution")')
    if not no_bootstrap:
        fixes.append("no bootstrap intervals (release.error_bar_reps = 0)")
    return (
        f"RELEASE SLOWER THAN THE WINDOW: a release of {counters:,} counters "
        f"({'B' if hashed else 'D'}) is expected to take ~{seconds:.1f} s (more under load)"
        f" and a window lasts {cfg.window.size:,} s, so releases would fall behind the "
        f"windows; fix: {' or '.join(fixes)}"
    )


def _plan_inputs(cfg: Config) -> tuple[int, float, int, int, bool]:
    """(counters, p, layers at release, events per window, hashed) of a configuration: the
    public inputs of the accuracy plan (:func:`accuracy_plan`)."""
    st = cfg.state
    hashed = st.mode == "hashed"
    counters = choose_buckets_for(cfg) if hashed else int(st.domain_size)
    layers = 1 + 2 * int(cfg.checkpoint.snapshots_per_window) + (st.model == "joint")
    # the service counts under the replace-one relation only (no setting chooses another)
    p = p_from_epsilon(float(st.epsilon), NEIGHBOR_RELATIONS["replace-one"])
    n = int(cfg.window.size) if cfg.window.kind == "count" else int(st.expected_n)
    return counters, p, layers, n, hashed


def planned_errors(cfg: Config, cancel=None) -> str:
    """The start line's second part: the expected relative errors the releases will state (the
    clause :func:`accuracy_plan` ends with; computed after the first line, off the loop).
    ``cancel``: see :func:`aggregator.release.planned_accuracy`."""
    counters, p, layers, n, hashed = _plan_inputs(cfg)
    clause = _planned_errors(counters, p, layers, n, hashed, cancel=cancel)
    return "accuracy plan: " + clause.split("; expected error of a release: ", 1)[1]


def _planned_errors(counters: int, p: float, layers: int, n: int, hashed: bool, cancel=None) -> str:
    """The expected relative errors the releases will state, from simulated windows of two
    reference shapes (aggregator.release.planned_accuracy), as a clause of the plan line."""

    plan = planned_accuracy(counters, p, layers, n, hashed=hashed, cancel=cancel)
    capped = (
        f" (simulated with {PLAN_MAX_EVENTS:,} events per window, not the {n:,} the "
        "window holds: the plan's cost is bounded, its figures are for that size)"
        if n > PLAN_MAX_EVENTS
        else ""
    )

    def pct(v):
        return "?" if v is None else f"+-{100 * v:.1f}%"

    parts = [
        f"{pct(v['distinct_items'])} distinct items, {pct(v['entropy_nats'])} entropy for "
        f"{PLAN_SHAPES[shape]}"
        + (" (BELOW THE NOISE: could be off by 2x)" if v["signal_below_noise"] else "")
        for shape, v in plan.items()
    ]
    return "; expected error of a release: " + "; ".join(parts) + capped


#: longest the simulated plan waits for the loop to catch up with its source before it runs anyway
PLAN_DEFER_S = 30.0


class StartPlan:
    """The accuracy plan a service logs at its start: the floor line at once
    (:func:`accuracy_plan`), then, with ``release.plan_errors``, the expected errors of simulated
    releases (:func:`planned_errors`, seconds) from a thread, so the loop starts at once.

    The simulation waits until the loop first finds nothing to read (:meth:`idle`), at most
    :data:`PLAN_DEFER_S`: it is seconds of CPU, and the GIL, that a service starting on a backlog
    would otherwise take from intake (on a 300,000-event backlog it cost the Kafka path 16 % of
    its events/s: docs/e2e.md).

    :meth:`close` cancels the thread and waits for the simulated window in hand: a process must
    not exit while the thread is inside native code (that aborts it)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self._cancel = threading.Event()
        self._idle = threading.Event()
        self._thread: threading.Thread | None = None

    def idle(self) -> None:
        """The loop found nothing to read: the simulation may run now."""
        self._idle.set()

    def start(self) -> None:
        line, below = accuracy_plan(self.cfg, simulate=False)
        if self.cfg.state.privacy_unit == "user":  # the plan is computed, not simulated
            log.info("%s", line)
            return
        simulate = self.cfg.release.plan_errors
        if not simulate:  # no simulated releases at this start
            line += (
                "; expected errors not simulated (release.plan_errors = false; "
                "panagg plan gives them)"
            )
        (log.warning if below or release_time_warning(self.cfg) else log.info)("%s", line)
        if not simulate:
            return
        self._cancel.clear()
        self._thread = threading.Thread(target=self._simulate, name="panagg-plan", daemon=True)
        self._thread.start()

    def _simulate(self) -> None:
        deadline = time.monotonic() + PLAN_DEFER_S
        while not (self._idle.is_set() or self._cancel.is_set()) and time.monotonic() < deadline:
            self._idle.wait(0.2)
        if self._cancel.is_set():
            return
        try:
            log.info("%s", planned_errors(self.cfg, cancel=self._cancel.is_set))
        except PlanCancelled:
            pass  # stopped before the plan was done: no line
        except Exception as exc:  # a plan is advice: it never stops the service
            log.warning(
                "accuracy plan: expected errors not computed (%s: %s)", type(exc).__name__, exc
            )

    def close(self) -> None:
        thread = self._thread
        if thread is None:
            return
        self._cancel.set()
        # it stops at its next simulated window (seconds); on a loaded machine that window can
        # take longer, and a process that exits while the thread is inside native code aborts
        # (exit -6, "terminate called without an active exception": two rename tests of several
        # aggregations in a loaded suite run), so the stop waits for it
        thread.join(timeout=10)
        if thread.is_alive():
            log.info("stopping: waiting for the accuracy plan's simulated window to end")
            thread.join()
        self._thread = None
