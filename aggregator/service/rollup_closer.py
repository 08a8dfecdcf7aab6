"""The rollups of one aggregator (``window.rollups``, docs/rollups.md): base windows' release
views kept, summed and released at 0 extra eps once every base window of a rollup is decided.

The order is what makes a rollup honest, and each step is idempotent:

1. :meth:`RollupCloser.keep_view`: a base window's release view is written only after its release
   entry is in the ledger (a file never holds a view the ledger did not decide);
2. :meth:`RollupCloser.fold`: each kept view is added to its rollups' sums (a sum names the uids
   it holds), then every rollup whose last base window is decided is closed;
3. closing asks the ledger first (:meth:`aggregator.service.ledger.Ledger.check_rollup`: every
   base window a ledgered release of this aggregation), estimates the sum (in the release worker
   when there is one: a week of 1e6 counters takes minutes), ledgers the release with the base
   windows it covers and queues its document for publishing.

A crash between a release's ledger entry and its view's file loses that window from its
rollups: the rollup then names it as missing, with why (never a silent under-count).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

from state_store.failpoints import failpoint

from ..release import release_from_view
from .errors import ServiceError
from .ledger import BudgetExceeded, Ledger
from .metrics import Metrics
from .rollup import (
    ROLLUP_ARGUMENT,
    RollupError,
    RollupStore,
    RollupSum,
    missing_caveat,
    rollup_block,
)

__all__ = ["RollupCloser", "ledgered_unpublished_rollups"]

log = logging.getLogger("panagg.service")


def span_length(window_size, windows: int):
    """The length of ``windows`` base windows (events or seconds, as window.size)."""
    return (
        int(window_size) * windows
        if float(window_size).is_integer()
        else float(window_size) * windows
    )


def ledgered_unpublished_rollups(ledger: Ledger, release_dir, pending: list) -> None:
    """At a start: queue in ``pending`` the document of every rollup the ledger holds but the
    release directory does not (a stop between its entry and the checkpoint holding it). Runs
    whether or not rollups are still configured: a ledgered release is always published."""
    rel_dir = Path(release_dir)
    for e in ledger.entries:
        if (
            e["kind"] == "rollup"
            and e.get("document")
            and not (rel_dir / f"release-{e['window']}.json").exists()
            and e["document"] not in pending
        ):
            pending.append(e["document"])


class RollupCloser:
    """Keeps, sums and releases the rollups of one aggregator.

    Parameters
    ----------
    directory
        Where the sums and the kept views live (``checkpoint.dir/rollups``).
    spans
        ``{span name: base windows per rollup}`` (:func:`aggregator.service.config.rollup_spans`).
    ledger, metrics
        The aggregator's ledger and metrics.
    model, loss, method, error_bar_reps
        How a rollup's release is estimated (as the base windows' releases).
    stream, aggregation
        What the ledger entry names (the counted stream, the aggregation's name or "").
    base_kind, window_size
        The base windows' ``window.kind`` and ``window.size`` (a rollup's length is a multiple).
    annotate
        ``annotate(release, window_info)``: what the service adds to every release document.
    worker
        Returns the release worker, or None to estimate in the calling thread (the aggregator
        gets its worker after it is built).
    """

    def __init__(
        self,
        directory,
        spans: dict[str, int],
        *,
        ledger: Ledger,
        metrics: Metrics,
        model: str,
        loss: str,
        method: str | None,
        error_bar_reps: int,
        stream: str,
        aggregation: str,
        base_kind: str,
        window_size,
        annotate: Callable[[dict, dict], None],
        worker: Callable[[], object],
    ):
        self.spans = dict(spans)
        self.store = RollupStore(Path(directory), self.spans)
        self.ledger, self.metrics = ledger, metrics
        self.model, self.loss, self.method = model, loss, method
        self.error_bar_reps = int(error_bar_reps)
        self.stream, self.aggregation = stream, aggregation
        self.base_kind, self.window_size = base_kind, window_size
        self.annotate, self.worker = annotate, worker
        #: rollups being estimated in the release worker, in close order
        self.jobs: list[dict] = []

    def keep_view(self, closing: dict, release: dict, counts, layers: int) -> None:
        """Keep a ledgered base window's release view (atomically; call only after its release
        entry is in the ledger)."""
        meta = {
            "p": float(release["p"]),
            "mode": release["domain"]["mode"],
            "size": int(release["domain"]["size"]),
            "epsilon": float(release["epsilon"]),
            "neighbor": release["neighbor"],
            "events": int(closing.get("events", 0)),
            "started_unix": closing.get("started_unix"),
            "ended_unix": closing.get("ended_unix"),
        }
        failpoint("rollup-before-view")
        self.store.put_inbox(
            closing["uid"], closing["id"], counts, layers=int(layers), n=release.get("n"), meta=meta
        )
        failpoint("rollup-view-kept")

    def fold(self, pending: list) -> None:
        """Add every kept view to its rollups' sums, then close the rollups whose last base
        window is decided (their documents are appended to ``pending``)."""
        for meta, counts in self.store.inbox():
            uid, wid = meta["uid"], int(meta["window"])
            if self.ledger.get(f"release-{uid}") is None:  # a view is kept after its entry
                log.error(
                    "rollups: the kept view of window %s is not a ledgered release; it is "
                    "dropped (it is in no rollup)",
                    wid,
                )
                self.store.drop_inbox(uid)
                continue
            for span, k in self.spans.items():
                idx = wid // k
                if self.ledger.has(f"rollup-{span}-{idx}") or self.ledger.has(
                    f"rollup-refused-{span}-{idx}"
                ):
                    log.warning(
                        "rollups: window %s was released after rollup %s-%s; it is not in it",
                        wid,
                        span,
                        idx,
                    )
                    continue
                try:
                    r = self.store.load(span, idx) or RollupSum(
                        span, idx, windows=k, p=meta["p"], mode=meta["mode"], size=meta["size"]
                    )
                    added = r.update(uid, wid, counts, layers=meta["layers"], n=meta["n"])
                except RollupError as exc:
                    raise ServiceError(
                        f"rollups: {exc}; move {self.store.dir / span} aside "
                        "to start this rollup afresh"
                    ) from None
                if added:
                    r.parts[uid].update(
                        events=meta.get("events"),
                        started_unix=meta.get("started_unix"),
                        ended_unix=meta.get("ended_unix"),
                        epsilon=meta["epsilon"],
                        neighbor=meta["neighbor"],
                    )
                    self.store.save(r)
                    failpoint("rollup-folded")
            self.store.drop_inbox(uid)
        decided = [
            e["window"]
            for e in self.ledger.entries
            if e["kind"] in ("release", "refused") and isinstance(e.get("window"), int)
        ]
        if not decided:
            return
        last = max(decided)
        for span, k in self.spans.items():
            for idx in self.store.open_indices(span):
                if (idx + 1) * k - 1 <= last:
                    self._close(pending, span, idx)

    def _close(self, pending: list, span: str, idx: int) -> None:
        """Release rollup ``span`` #``idx`` from its sum: the ledger is asked first (every base
        window a ledgered release of this aggregation), the entry names them and charges 0."""
        name, rid = f"{span}-{idx}", f"rollup-{span}-{idx}"
        if any((j["span"], j["idx"]) == (span, idx) for j in self.jobs):
            return  # being estimated in the release worker
        r = self.store.load(span, idx)
        if r is None or self.ledger.has(rid) or self.ledger.has(f"rollup-refused-{span}-{idx}"):
            self.store.remove(span, idx)
            return
        try:
            entries = self.ledger.check_rollup(name, list(r.parts), aggregation=self.aggregation)
        except BudgetExceeded as exc:
            log.error("%s", exc)
            self.ledger.append(
                entry_id=f"rollup-refused-{span}-{idx}",
                kind="refused-rollup",
                window=name,
                model=self.model,
                note=str(exc),
                rollup=span,
            )
            self.store.remove(span, idx)
            return
        by_window = {
            e["window"]: e
            for e in self.ledger.entries
            if e["kind"] in ("release", "refused") and isinstance(e.get("window"), int)
        }
        missing = []
        for w in r.missing():
            e = by_window.get(w)
            if e is None:
                why = "not counted here (before this service's first window, or no such window)"
            elif e["kind"] == "refused":
                why = "refused by the ledger (budget): it has no release"
            else:
                why = (
                    "released, but its view was lost in a crash between its ledger entry and "
                    "the rollup's files (docs/rollups.md)"
                )
            missing.append({"window": w, "why": why})
        parts = sorted(r.parts.values(), key=lambda v: v["window"])
        first = parts[0]
        job = {
            "span": span,
            "idx": idx,
            "rollup": r,
            "parts": parts,
            "entries": entries,
            "missing": missing,
        }
        kwargs = dict(
            p=r.p,
            layers=r.layers,
            n=r.n,
            epsilon=float(first["epsilon"]),
            neighbor=first["neighbor"],
            mode=r.mode,
            size=r.size,
            window=name,
            loss=self.loss,
            error_bar_reps=self.error_bar_reps,
            method=self.method,
        )
        worker = self.worker()
        if worker is not None:  # beside the loop: a week of 1e6 counters takes minutes
            job["future"] = worker.call(release_from_view, r.counts, **kwargs)
            self.jobs.append(job)
            return
        self._finish(pending, job, release_from_view(r.counts, **kwargs))

    def collect(self, pending: list, *, wait: bool = False) -> None:
        """Ledger and queue the rollups the release worker has estimated (in close order; with
        ``wait``, every one in flight)."""
        while self.jobs and (wait or self.jobs[0]["future"].done()):
            job = self.jobs.pop(0)
            try:
                release = job["future"].result()
            except Exception as exc:
                log.error(
                    "the release of rollup %s-%s failed in the release worker (%s: %s); "
                    "its sum stays in %s and it is released at the next start",
                    job["span"],
                    job["idx"],
                    type(exc).__name__,
                    exc,
                    self.store.dir,
                )
                continue
            self._finish(pending, job, release)

    def _finish(self, pending: list, job: dict, release: dict) -> None:
        span, idx, r, parts = job["span"], job["idx"], job["rollup"], job["parts"]
        missing, entries = job["missing"], job["entries"]
        name, rid = f"{span}-{idx}", f"rollup-{span}-{idx}"
        if self.ledger.has(rid):
            return
        started = [v.get("started_unix") for v in parts if v.get("started_unix") is not None]
        ended = [v.get("ended_unix") for v in parts if v.get("ended_unix") is not None]
        self.annotate(
            release,
            {
                "kind": "rollup",
                "size": span_length(self.window_size, r.windows),
                "events": sum(int(v.get("events") or 0) for v in parts),
                "started_unix": min(started) if started else None,
                "ended_unix": max(ended) if ended else None,
            },
        )
        release["window_info"]["base_kind"] = self.base_kind
        release["rollup"] = rollup_block(r, missing, r.layers)
        if missing:
            release["caveat"] = missing_caveat(name, len(parts), r.windows, missing)
            log.warning(
                "rollup %s holds %d of %d base windows (%d missing; the release says "
                "which and why)",
                name,
                len(parts),
                r.windows,
                len(missing),
            )
        doc = json.dumps(release, allow_nan=False)
        self.ledger.append(
            entry_id=rid,
            kind="rollup",
            window=name,
            epsilon_spent=0.0,
            model=self.model,
            document=doc,
            rollup=span,
            note=ROLLUP_ARGUMENT,
            base_windows=[
                {"window": e["window"], "uid": e["window_uid"], "seq": e["seq"], "hash": e["hash"]}
                for e in entries
            ],
            missing=[m["window"] for m in missing],
            n=r.n,
            stream=self.stream,
            aggregation=self.aggregation,
        )
        failpoint("rollup-ledgered")
        pending.append(doc)
        self.store.remove(span, idx)
        self.metrics.rollup_released(span, release)
        log.info(
            "rollup %s: %d base windows, %d noise layers, n=%s, released at 0 extra eps "
            "(estimated in %.1f s)",
            name,
            len(parts),
            r.layers,
            r.n,
            release.get("release_seconds", float("nan")),
        )
