"""The ledger's question before any release noise is drawn: may this window be released, given
every earlier charge on the events it covers?

A window's release reveals the records of a range of source positions per partition
(:func:`covered_ranges`). The gate asks the ledger about those positions, not about a window
number: a crash inside the close, a fresh start, a renamed aggregation or a restored ledger
cannot re-release an event past its budget, because its position is charged whatever window,
uid or aggregation covered it before (:mod:`.charges`). The stream's other aggregations count
against the same per-event budget (their ledgers are read too), and so do the windows already
handed to the release worker (charged as if ledgered: their entries follow).

Under the user unit positions do not bound a person (one user's events are at many positions,
in every window): the gate asks the per-user budget too (:mod:`.user_budget`), over this
ledger's user-level charges and those other deployments on the same stream wrote to the budget
registry.

A refusal is itself ledgered with the ranges it covers, so every process and every restart
gets the same answer, and a restart does not replay a refused window.

>>> covered_ranges({"p0": 100, "p1": 7}, {"p0": 250, "p1": 7, "p2": 9})
{'p0': [100, 250]}
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from state_store.registry import RegistryError, ledger_id

from .errors import ServiceError
from .ledger import BudgetExceeded, Ledger, LedgerError, _ranges_text, sibling_ledger_paths
from .metrics import Metrics
from .user_budget import USER_EPSILON, USER_STREAM, UserBudget, user_spent

__all__ = ["ReleaseGate", "covered_ranges", "check_registry"]

log = logging.getLogger("panagg.service")


def covered_ranges(start_offsets: dict | None, end_offsets: dict) -> dict:
    """The source positions ``[start, end)`` per partition a window covers: from where its first
    record of the partition was (``start_offsets``) to the current position. A partition the
    window never counted from has no start and is not covered; an empty range is left out."""
    starts = start_offsets or {}
    out = {}
    for part, end in end_offsets.items():
        if part not in starts:
            continue
        start = int(starts[part])
        if int(end) > start:
            out[part] = [start, int(end)]
    return out


def check_registry(
    registry,
    ledger: Ledger,
    known: set,
    uid: str,
    epsilon: float,
    *,
    window,
    ranges: dict,
    lineage,
    window_kind,
    others=(),
    pending: float = 0.0,
    parallel: dict | None = None,
) -> None:
    """BudgetExceeded, in one line naming the other deployment, when the budget ``registry``'s
    charges beyond ``known`` (the (ledger id, entry id) pairs the checking ledgers hold) bring
    the window's events over ``ledger``'s per-event budget. The registry is read already."""
    theirs = registry.charges(known)
    if not theirs:
        return
    try:
        ledger.check_release(
            uid,
            epsilon,
            window=window,
            ranges=ranges,
            lineage=lineage,
            window_kind=window_kind,
            others=[*others, *theirs],
            pending=pending,
            parallel=parallel,
        )
    except BudgetExceeded:
        raise BudgetExceeded(
            f"release of window {window} refused: its events (source positions "
            f"{_ranges_text(ranges)}) were released by {registry.who(ranges, theirs)} "
            f"(the budget registry {registry.topic}), and this release would bring them "
            f"over the per-event budget {ledger.budget_per_event:g}; nothing of it is "
            "published (one deployment per stream, or one that starts after those "
            "positions: docs/privacy.md section 22)"
        ) from None


class ReleaseGate:
    """Charges releases by the events they cover, in one aggregator's ledger.

    Parameters
    ----------
    ledger, metrics
        The aggregator's ledger (its budgets) and metrics (refusals are counted).
    epsilon, model
        What one window's release costs, and the noise model ledgered with it.
    stream, aggregation
        What the entries name: the counted stream and the aggregation ("" when it is the only
        one).
    directory
        The aggregator's state directory; a named aggregation's siblings (``../*/ledger.jsonl``)
        hold the stream's other charges.
    """

    def __init__(
        self,
        ledger: Ledger,
        metrics: Metrics,
        *,
        epsilon: float,
        model: str,
        stream: str,
        aggregation: str,
        directory,
        parallel: dict | None = None,
    ):
        self.ledger, self.metrics = ledger, metrics
        #: a breakdown's key: {"group", "member"}, recorded with each release and refusal (the
        #: charge book takes the largest of a group's members at a position, not their sum)
        self.parallel = (
            {"group": parallel["group"], "member": parallel["member"]} if parallel else None
        )
        self.epsilon, self.model = float(epsilon), model
        self.stream, self.aggregation = stream, aggregation
        self.dir = Path(directory)
        #: the cluster's budget registry (state_store/registry.py), None without one
        self.registry = None
        #: a file source: partition name -> the content identity of the file (ledgered with
        #: each release, the key of its charges in the file registry)
        self.sources: dict[str, str] = {}
        #: the user unit's per-user budget (:mod:`.user_budget`), None under the event unit
        self.user_budget: UserBudget | None = None

    # -- the budget registry ----------------------------------------------------------------
    def attach_registry(self, registry) -> None:
        """Check every release against ``registry`` too, and record this ledger's charges there
        as they are ledgered (what a crash or an outage kept from it: at once, and before each
        check)."""
        self.registry = registry
        self.ledger.listeners.append(self._record)
        self._catch_up()

    def _record(self, entry: dict) -> None:
        try:
            self.registry.record(ledger_id(self.ledger.entries), entry)
        except Exception as exc:  # the release is ledgered; the charge follows at the next check
            log.warning(
                "the charge of %s is not in the budget registry yet (%s); it is "
                "written before the next release",
                entry.get("id"),
                type(exc).__name__,
            )

    def _catch_up(self) -> None:
        n = self.registry.catch_up(ledger_id(self.ledger.entries), self.ledger.entries)
        if n:
            log.info(
                "%d charge(s) of this ledger written to the budget registry %s",
                n,
                self.registry.topic,
            )

    def _known(self, siblings: list[list[dict]]) -> set[tuple[str, str]]:
        """(ledger id, entry id) of every entry this ledger and its ``siblings`` hold: the
        registry's charges beyond them are another deployment's (or lost from these)."""
        known = set()
        for entries in [self.ledger.entries, *siblings]:
            lid = ledger_id(entries)
            known |= {(lid, e["id"]) for e in entries}
        return known

    def _check_registry(
        self,
        uid: str,
        wid: int,
        *,
        ranges: dict,
        charge: float,
        closing: dict,
        siblings: list,
        others: list,
        pending: float,
    ) -> None:
        """BudgetExceeded naming the other deployment when the registry's charges bring the
        window's events over the per-event budget."""
        # a Kafka client is loaded by a Kafka run only
        from kafka.errors import KafkaError  # noqa: PLC0415

        started = time.perf_counter()
        try:
            self.registry.read_to_end()
            self._catch_up()
        except (KafkaError, RegistryError, OSError) as exc:
            # the cluster is away (the source with it): the ledger's own check stands, and the
            # charges this misses are read at the next release
            log.warning(
                "the budget registry %s could not be read (%s): window %s is checked "
                "against this deployment's ledgers only",
                self.registry.topic,
                type(exc).__name__,
                wid,
            )
        translate = getattr(self.registry, "translate", None)  # a file source: by content
        try:
            check_registry(
                self.registry,
                self.ledger,
                self._known(siblings),
                uid,
                charge,
                window=wid,
                ranges=translate(ranges) if translate else ranges,
                lineage=closing.get("lineage"),
                window_kind=closing.get("kind"),
                others=others,
                pending=pending,
                parallel=self.parallel,
            )
        finally:  # a refusal's check took its time too
            self.metrics.registry_check.observe(time.perf_counter() - started)

    def charge_of(self, closing: dict) -> float:
        """What the window's release costs: epsilon, or 0 for a window without events (n is
        public under replace-one, and a state holding no event reveals none)."""
        return self.epsilon if int(closing.get("events", 0)) > 0 else 0.0

    def position_fields(self, closing: dict, ranges: dict, end_offsets: dict, totals: dict) -> dict:
        """What a release or refusal records of the source: the ranges it covers, the end a
        restart resumes at, the totals there, and whose chain of checkpoints it is."""
        return {
            "ranges": ranges,
            "end_offsets": dict(end_offsets),
            "totals": {
                "events": int(totals["events"]),
                "rejects": dict(totals["rejects"]),
                "filtered": int(totals.get("filtered", 0)),
            },
            "stream": self.stream,
            "aggregation": self.aggregation,
            "lineage": closing.get("lineage"),
            "window_kind": closing.get("kind"),
            "n": int(closing.get("events", 0)),
            **({"parallel": dict(self.parallel)} if self.parallel else {}),
            # a file source: the content identity of each file partition (the registry's key)
            **(
                {"sources": {p: c for p, c in self.sources.items() if p in ranges}}
                if self.sources and set(self.sources) & set(ranges)
                else {}
            ),
        }

    def other_charges(self) -> list[dict]:
        """Ledger entries of the stream's other aggregations (their charges count against the
        same per-event budget): every sibling directory's ledger, configured or not any more."""
        return [e for entries in self._sibling_ledgers() for e in entries]

    def _sibling_ledgers(self) -> list[list[dict]]:
        """The entries of each other aggregation's ledger of this stream, ledger by ledger."""
        if not self.aggregation:
            return []
        out = []
        for path in sibling_ledger_paths(self.dir):
            try:
                out.append(Ledger(path, budget_per_window=1.0).entries)
            except LedgerError as exc:
                raise ServiceError(
                    f"{exc} (another aggregation's ledger: its charges count "
                    "against this stream's per-event budget)"
                ) from None
        return out

    def same_records(self) -> dict[str, set[str]]:
        """Topic -> the topics whose records it holds copies of, as the operator stated them
        (``--accept-change --same-records-as OLD``: the ledger's identity entries), followed
        through chains of changes."""
        direct: dict[str, set[str]] = {}
        for e in self.ledger.entries:
            m = e.get("same_records_as") if e.get("kind") == "identity" else None
            if m:
                direct.setdefault(m["to"], set()).add(m["from"])
        out = {}
        for topic in direct:
            seen, todo = set(), list(direct[topic])
            while todo:
                one = todo.pop()
                if one not in seen and one != topic:
                    seen.add(one)
                    todo.extend(direct.get(one, ()))
            out[topic] = seen
        return out

    def same_records_charges(self, ranges: dict, others: list) -> list[dict]:
        """Charges standing for the old topic's on a topic that holds copies of its records:
        every position of the new topic is charged as the old topic's most-charged position
        (a copy's offsets need not be the original's, so no finer mapping is safe)."""
        copies = self.same_records()
        if not copies:
            return []
        theirs = []
        if self.registry is not None and not getattr(self.registry, "sources", None):
            theirs = self.registry.charges(self._known(self._sibling_ledgers()))
        book = self.ledger.charges([*others, *theirs])
        out = []
        for topic, olds in copies.items():
            mine = {p: ab for p, ab in ranges.items() if p.rpartition(":")[0] == topic}
            if not mine:
                continue
            parts = [p for p in book.charged_partitions() if p.rpartition(":")[0] in olds]
            most = book.most(parts)
            if most > 0:
                out.append(
                    {
                        "kind": "release",
                        "epsilon_spent": most,
                        "ranges": mine,
                        "lineage": None,
                        "window_kind": "count",
                    }
                )
        return out

    # -- the user unit's per-user budget ---------------------------------------------------
    def user_stream(self) -> str:
        """The stream a user-level charge is on: a file's content identity (with the file
        registry: a renamed or grown file is the same stream), else ``kafka:<topic>`` or
        ``file:<name>``."""
        return next(iter(self.sources.values()), self.stream)

    def user_streams(self) -> set[str]:
        """The streams whose users are this stream's: itself, the topics whose records it holds
        copies of (``--same-records-as``) and earlier looks at the same file content."""
        out = {self.user_stream()}
        out |= {f"kafka:{old}" for olds in self.same_records().values() for old in olds}
        content_ids = getattr(self.registry, "content_ids", None)
        return out | (content_ids() if content_ids else set())

    def user_charge_fields(self, uid: str, charge: float) -> dict:
        """What the release of window ``uid`` at ``charge`` records of what it charged every
        user (:meth:`.UserBudget.charge_of`): nothing under the event unit."""
        if self.user_budget is None:
            return {}
        return self.user_budget.fields(self.user_budget.charge_of(uid, charge), self.user_stream())

    def user_charges_elsewhere(self, siblings=()) -> list[dict]:
        """The budget registry's user-level charges on this stream that this directory's ledgers
        do not hold (other deployments', or this ledger's lost ones), as last read."""
        if self.registry is None:
            return []
        streams = self.user_streams()
        known = self._known(list(siblings))
        return [
            v
            for v in self.registry.records.values()
            if float(v.get(USER_EPSILON) or 0.0) > 0
            and v.get(USER_STREAM) in streams
            and (v["ledger"], v["entry"]) not in known
        ]

    def user_budget_line(self) -> str | None:
        """The start's line on the per-user budget (None under the event unit)."""
        if self.user_budget is None:
            return None
        levels = self._sibling_ledgers()  # (window.rollups under the user unit: one per span)
        self.user_budget.elsewhere = user_spent(self.user_charges_elsewhere(levels))
        self.user_budget.levels = user_spent(e for entries in levels for e in entries)
        return self.user_budget.line()

    def allows(
        self,
        uid: str,
        wid: int,
        *,
        ranges: dict,
        charge: float,
        closing: dict,
        in_flight=(),
        refusal_fields: Callable[[], dict] = dict,
    ) -> bool:
        """The ledger's answer for window ``uid`` covering the source ``ranges`` at ``charge``;
        ``in_flight``: the jobs handed to the release worker and not yet ledgered. A refusal is
        ledgered with ``refusal_fields()`` (its position fields) and counted."""
        if self.ledger.has(f"refused-{uid}"):
            return False
        try:
            flying = [
                {
                    "kind": "release",
                    "epsilon_spent": j["charge"],
                    "ranges": j["ranges"],
                    "lineage": j["window"].get("lineage"),
                    "window_kind": j["window"].get("kind"),
                    "parallel": self.parallel,
                }
                for j in in_flight
            ]
            siblings = self._sibling_ledgers() if ranges else []
            others = [*(e for entries in siblings for e in entries), *flying] if ranges else []
            pending = sum(j["charge"] for j in in_flight)
            if ranges:
                others += self.same_records_charges(ranges, others)
            self.ledger.check_release(
                uid,
                charge,
                window=wid,
                ranges=ranges,
                lineage=closing.get("lineage"),
                window_kind=closing.get("kind"),
                others=others,
                pending=pending,
                parallel=self.parallel,
            )
            if self.registry is not None and ranges and charge > 0:
                self._check_registry(
                    uid,
                    wid,
                    ranges=ranges,
                    charge=charge,
                    closing=closing,
                    siblings=siblings,
                    others=others,
                    pending=pending,
                )
            if self.user_budget is not None and charge > 0:  # (the registry is read by now)
                levels = siblings if ranges else self._sibling_ledgers()
                self.user_budget.check(
                    wid,
                    self.user_budget.charge_of(uid, charge),
                    self.user_charges_elsewhere(levels),
                    pending=pending,
                    levels=[e for entries in levels for e in entries],
                )
        except BudgetExceeded as exc:
            log.error("%s", exc)
            self.metrics.releases_refused.inc()
            self.ledger.append(
                entry_id=f"refused-{uid}",
                kind="refused",
                window=wid,
                window_uid=uid,
                model=self.model,
                note=str(exc),
                **refusal_fields(),
            )
            return False
        return True
