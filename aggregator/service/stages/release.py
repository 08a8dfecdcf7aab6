"""Close and release: what a closed window's counters become, in every mode.

A window's release is computed once and ledgered *with its document* before anything that
depends on it is durable; publishing happens from that document (:mod:`..publisher`), so a
crash after the ledger entry re-publishes the ledgered release, never a second computation.
The budget is asked before any release noise is drawn (:class:`..release_gate.ReleaseGate`,
over the source positions the window covers).

:class:`ReleaseStep` does it either in the loop (:meth:`ReleaseStep.ledgered_release`) or beside
it (:meth:`ReleaseStep.submit` hands the closed counters to the release worker,
:meth:`ReleaseStep.ledger_finished` ledgers the finished ones in window order). Which window
opens next, and the checkpoints that follow, are the caller's (the window assigner's). The
rollups (``window.rollups``: sums of consecutive windows' views, released at their ends) close
beside it: :func:`rollups_for` builds their :class:`..rollup_closer.RollupCloser`.

Invariant: the ledger entry of a release holds the released (noised) document only; the
counters never leave memory except to the release worker's shared block. Durable writes: the
``release-<uid>`` ledger entries (and, through the gate, ``refused-<uid>``).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

from state_store.failpoints import failpoint

from ...density import PanPrivateDensity
from ...release import make_release, stamp_window
from ..accuracy_plan import warn_if_below_noise
from ..config import rollup_spans
from ..errors import ServiceError
from ..identity import identity_of, item_identity
from ..ledger import Ledger
from ..metrics import Metrics
from ..release_gate import ReleaseGate, covered_ranges
from ..rollup_closer import RollupCloser
from ..settings import Config
from ..user_window import is_user, user_release
from ..window import WindowTask

__all__ = ["ReleaseStep", "annotate", "release_method", "rollups_for"]

log = logging.getLogger("panagg.service")


def release_method(cfg: Config) -> str | None:
    """``release.estimator``: None for the grid's default, else the named estimator."""
    name = cfg.release.estimator
    return None if name == "default" else name


def rollups_for(
    cfg: Config,
    directory: Path,
    gate: ReleaseGate,
    metrics: Metrics,
    *,
    annotate: Callable[[dict, dict], None],
    worker: Callable[[], object],
) -> RollupCloser | None:
    """``window.rollups``' closer (its sums under ``directory/rollups``; the gate's ledger,
    stream and aggregation), None without rollups; ``annotate`` completes a release document
    (:meth:`ReleaseStep.annotate`), ``worker()`` is the release worker now."""
    spans = rollup_spans(cfg)  # type: ignore[arg-type]  # (it reads a Config too)
    if not spans:
        return None
    return RollupCloser(
        Path(directory) / "rollups",
        spans,
        ledger=gate.ledger,
        metrics=metrics,
        model=cfg.state.model,
        loss=cfg.state.loss,
        method=release_method(cfg),
        error_bar_reps=int(cfg.release.error_bar_reps),
        stream=gate.stream,
        aggregation=gate.aggregation,
        base_kind=cfg.window.kind,
        window_size=cfg.window.size,
        annotate=annotate,
        worker=worker,
    )


def annotate(release: dict, closing: dict, cfg: Config, epsilon: float) -> None:
    """What the service adds to a release document: the window, what was counted, which
    aggregation."""
    release["window_info"] = {
        k: closing[k] for k in ("kind", "size", "events", "started_unix", "ended_unix")
    }
    if closing["kind"] == "event_time":
        release["window_info"].update(
            {k: closing.get(k) for k in ("event_start_unix", "event_end_unix", "late")},
            late_policy=cfg.window.late,
            allowed_lateness_s=cfg.window.allowed_lateness_s,
        )
    release["counted"] = {"stream": identity_of(cfg)["stream"], "item": item_identity(cfg)}
    if cfg.aggregation:
        release["aggregation"] = dict(cfg.aggregation.to_dict(), epsilon=epsilon)
        level = release["aggregation"].pop("rollup_level", None)
        if level:
            release["rollup_level"] = level
    stamp_window(release)


class ReleaseStep:
    """The release of one aggregation's closed windows.

    Parameters
    ----------
    cfg
        The service's settings (``release.*``, the window and item for the document).
    ledger
        The privacy ledger: every release is an entry with its document.
    gate
        Asks the ledger (and the budget registry) before any release noise is drawn.
    metrics
        Release durations, latency, queue length, the budget gauges.
    epsilon, model, loss
        The state's epsilon, the privacy model and the loss of the estimators.
    rng
        ``rng(*tag)``: the release layer's generator (None: the OS CSPRNG).
    rollups
        The rollup closer, or None (set after construction: it annotates through this step).
    """

    def __init__(
        self,
        cfg: Config,
        ledger: Ledger,
        gate: ReleaseGate,
        metrics: Metrics,
        *,
        epsilon: float,
        model: str,
        loss: str,
        rng: Callable,
        rollups=None,
    ):
        self.cfg, self.ledger, self.gate, self.metrics = cfg, ledger, gate, metrics
        self.epsilon, self.model, self.loss, self.rng = epsilon, model, loss, rng
        self.rollups = rollups
        #: (window, started, ended) of each release the worker computed (wall clock; kept in
        #: the process for latency figures, never in a document)
        self.runs: list[tuple[int, float, float]] = []

    def beside_loop(self) -> bool:
        """Whether releases run beside the loop (``release.workers`` > 0): every window kind,
        with or without snapshots (several aggregations share one worker pool); scale-out
        releases in the loop (docs/configuration.md), and so does the user unit (its release is
        one count of bits)."""
        return int(self.cfg.release.workers) > 0 and not is_user(self.cfg)

    def annotate(self, release: dict, closing: dict) -> None:
        """:func:`annotate` with this aggregation's settings."""
        annotate(release, closing, self.cfg, self.epsilon)

    def ledgered_release(
        self, task: WindowTask, closing: dict, position_fields: Callable[[dict], dict]
    ) -> dict | None:
        """The window's release in the loop: from the ledger if it is there, else computed once
        (after the budget check over its source ranges, before anything is durable) and
        ledgered with its document, its ranges and ``position_fields(ranges)`` (the totals at
        its end). None: refused (the gate ledgered the refusal)."""
        wid, uid = closing["id"], closing["uid"]
        entry = self.ledger.get(f"release-{uid}")
        if entry is not None:
            log.info("window %s is already in the ledger: re-publishing its ledgered release", wid)
            return json.loads(entry["document"])
        ranges = covered_ranges(closing.get("start_offsets"), task.offsets)
        charge = self.gate.charge_of(closing)
        if not self.gate.allows(
            uid,
            wid,
            ranges=ranges,
            charge=charge,
            closing=closing,
            refusal_fields=lambda: position_fields(ranges),
        ):
            return None
        view: list | None = [] if self.rollups is not None else None
        state = task.live_state()
        release = (
            user_release(
                cast(PanPrivateDensity, state),
                self.cfg,
                window=wid,
                n=int(closing["events"]),
                rng=self.rng(1, wid),
            )
            if is_user(self.cfg)
            else make_release(
                state,
                model=self.model,
                loss=self.loss,
                window=wid,
                rng=self.rng(1, wid),
                error_bar_reps=int(self.cfg.release.error_bar_reps),
                method=release_method(self.cfg),
                view=view,
            )
        )
        if charge > 0:
            warn_if_below_noise(release)
        else:
            log.info("window %s had no events: released at epsilon 0 (it holds only noise)", wid)
        self.annotate(release, closing)
        if self.gate.user_budget is not None:  # what every user has spent, this one included
            release["per_user_budget"] = self.gate.user_budget.document(
                self.gate.user_budget.charge_of(uid, charge)
            )
        doc = json.dumps(release, allow_nan=False)
        self.ledger.append(
            entry_id=f"release-{uid}",
            kind="release",
            window=wid,
            window_uid=uid,
            epsilon_spent=charge,
            model=self.model,
            document=doc,
            **position_fields(ranges),
            **self.gate.user_charge_fields(uid, charge),
        )
        if view:
            self.rollups.keep_view(closing, release, *view[0])
        return release

    def submit(
        self,
        worker,
        task: WindowTask,
        closing: dict,
        *,
        start,
        ranges: dict,
        charge: float,
        extra: dict,
    ) -> dict:
        """Hand ``task``'s closed counters to ``worker`` (the gate allowed the release); the
        job, to go in ``task.inflight`` (collected in window order: :meth:`ledger_finished`)."""
        wid = closing["id"]
        future = worker.submit(
            task.state,
            model=self.model,
            loss=self.loss,
            window=wid,
            rng=self.rng(1, wid),
            error_bar_reps=int(self.cfg.release.error_bar_reps),
            method=release_method(self.cfg),
            keep_view=self.rollups is not None,
        )
        return {
            "window": closing,
            "start": start,
            "ranges": ranges,
            "charge": charge,
            "end_offsets": dict(task.offsets),
            "totals": copy.deepcopy(task.totals),
            "future": future,
            "extra": extra,
        }

    def ledger_finished(
        self,
        task: WindowTask,
        *,
        wait: bool = False,
        on_checkpoint: Callable[[WindowTask, object], None],
    ) -> tuple[int, bool]:
        """Ledger the worker's finished releases of ``task.inflight`` in window order (with
        ``wait``: every one in flight), each into ``task.pending``. A job that carries the
        checkpoint starting its next window (event time) has it written at once
        (``on_checkpoint``). Returns (how many, whether a checkpoint was written)."""
        done = 0
        committed = False  # event time: each window's next start is committed as it is ledgered
        while task.inflight and (wait or task.inflight[0]["future"].done()):
            job = task.inflight[0]
            try:
                release, started, ended, *view = job["future"].result()
            except Exception as exc:
                raise ServiceError(
                    f"the release of window {job['window']['id']} failed in the "
                    f"release worker ({type(exc).__name__}: {exc}); it is "
                    "replayed and released at the next start"
                ) from None
            closing = job["window"]
            self.annotate(release, closing)
            if job["charge"] > 0:
                warn_if_below_noise(release)
            else:
                log.info(
                    "window %s had no events: released at epsilon 0 (it holds only noise)",
                    closing["id"],
                )
            doc = json.dumps(release, allow_nan=False)
            self.ledger.append(
                entry_id=f"release-{closing['uid']}",
                kind="release",
                window=closing["id"],
                window_uid=closing["uid"],
                epsilon_spent=job["charge"],
                model=self.model,
                document=doc,
                **self.gate.position_fields(
                    closing, job["ranges"], job["end_offsets"], job["totals"]
                ),
                **self.gate.user_charge_fields(closing["uid"], job["charge"]),
                **job.get("extra", {}),
            )
            failpoint("release-ledgered")
            task.pending.append(doc)
            task.inflight.pop(0)
            if view:
                self.rollups.keep_view(closing, release, *view[0])
                self.rollups.fold(task.pending)
            if job.get("checkpoint") is not None:
                # event time: at once (its start was fixed at the close, whatever the loop does
                # now), so that at most one ledgered window is ahead of the checkpoint (a
                # restart passes that one: _skip_decided_event_window)
                on_checkpoint(task, job["checkpoint"])
                committed = True
            self.runs.append((closing["id"], started, ended))
            self.metrics.release_duration.observe(ended - started)
            self.metrics.release_latency.observe(max(0.0, time.time() - closing["ended_unix"]))
            done += 1
        if done:
            self.metrics.release_queue.set(len(task.inflight))
            self.metrics.budget(self.ledger.spent(), self.ledger.remaining(), self.gate.user_budget)
        return done, committed
