"""The group's one authority for the budget: charges, merges and publishes each window.

The leader is the member the counting group assigns the ledger topic's one partition (ownership
from the group's assignment alone, no lock). It

* fences any earlier leader (a transactional producer with the group's fixed leader id: the
  broker aborts the old one's open transaction and refuses its later ones), then reads the
  ledger to its end;
* writes the group's identity as the ledger's first entry when the ledger is empty;
* reads the summaries topic; once window w has the summaries of all P partitions (and every
  window before w is decided), merges them in the release worker
  (:func:`~aggregator.service.group.summary.merge_summaries`, deterministic) and, in one
  transaction, appends the ledger entry (the window's positions on every partition, the epsilon
  charged), writes the document to ``<group>.panagg.releases`` (and ``release.topic``) and
  tombstones the window's summaries. Then it writes the local release file.

A window whose summaries exist was seen (the summaries are views of its events), so it is charged
whether or not it is published: if any partition refused its window (its positions were charged
before), the window is ledgered as withheld, its other partitions' positions charged, and nothing
of it is published. A leader that dies anywhere in this leaves the window undecided; the next
leader reads the same summaries and decides it once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from kafka import TopicPartition
from kafka.errors import KafkaError

from state_store.audit import AuditKeyError, load_key, save_export, signed_export
from state_store.registry import RegistryError, ledger_id

from ...release import stamp_window, write_release
from ...state import PanPrivateHistogram
from ..ledger import BudgetExceeded
from ..release_gate import check_registry
from .event_views import skipped_parts, window_info
from .export import assemble
from .forced import forced_window
from .summary import merge_summaries, source_ranges
from .view_format import distinct_views, state_params, sum_views, view_header

__all__ = ["Leader"]

log = logging.getLogger("panagg.group")

#: a window waiting this long after its end (beyond the close grace) names what it waits for
WAIT_NOTICE_S = 5.0


def _holds_events(have: dict) -> bool:
    """Whether the summaries or views ``have`` of one window count an event (or may: one
    without its ``n``, or a refused one, which is decided all the same)."""
    return any(s.get("n") is None or s.get("n") or s.get("refused") for s in have.values())


def _summary_keys(w: int, have: dict):
    """The summaries topic's keys of window ``w``'s summaries (and of views' chunks)."""
    for p in have:
        yield f"{w}/{p}".encode()
    for s in {id(s): s for s in have.values()}.values():
        for k in range(int(s.get("chunks") or 0)):
            yield f"{w}/{s['partition']}/c{k}".encode()


class Leader:
    """The ledger's writer while this member holds the ledger partition.

    Parameters
    ----------
    txn
        :class:`~aggregator.service.group.txn.Transactions` over the producer with id
        ``<group>.panagg.leader`` (``init_transactions`` done: that fenced the previous
        leader), made with ``remake=False``: a fenced leader stops leading.
    ledger
        :class:`~aggregator.service.group.ledger_topic.TopicLedger`, read to its end.
    summaries
        kafka-python consumer (no group, read_committed); assigned here to the summaries topic.
    identity
        The group identity (the ledger's first entry).
    merge
        ``merge(summaries) -> Future`` of the release document (the release worker), or None
        to merge in the loop.
    """

    def __init__(
        self,
        txn,
        ledger,
        summaries,
        topics,
        identity: dict,
        metrics,
        *,
        release_dir: str,
        release_topic: str = "",
        loss: str = "l1",
        error_bar_reps: int = 10,
        method: str | None = None,
        merge=None,
        grace_s: float = 2.0,
        aggregation: str = "",
        rollup_level: dict | None = None,
        requests=None,
        exports=None,
        audit_key_file: str = "",
        audit_dir: str = "",
        closer=None,
        max_in_flight: int = 2,
        merge_fn=merge_summaries,
        source_topic: str = "",
    ):
        self.txn, self.ledger, self.topics = txn, ledger, topics
        self.identity, self.metrics = identity, metrics
        self.release_dir, self.release_topic = release_dir, release_topic
        self.merge_kwargs = {"loss": loss, "error_bar_reps": int(error_bar_reps), "method": method}
        self.merge = merge
        #: the merge in the loop (no release worker): merge_summaries, or view_format.merge_views
        self.merge_fn = merge_fn
        #: scale.exchange = views: each summary is a member's view covering its partitions,
        #: sent as chunk messages before its header (views.py)
        self.views = identity.get("exchange") == "views"
        #: the topic whose partitions the summaries cover (views: the source's)
        self.counted_topic = source_topic if self.views and source_topic else topics.repartition
        self._chunks: dict[str, dict[int, bytes]] = {}
        #: the cluster's budget registry (views: the ledger's ranges are source positions;
        #: items: the entries' ``sources``; state_store/registry.py), set by the pipeline
        self.registry = None
        #: views: windows two views of one partition arrived for, and why (withheld)
        self._twice: dict[int, str] = {}
        self.grace_s = float(grace_s)
        self.aggregation = aggregation
        self.rollup_level = rollup_level
        #: forced releases and audit exports asked with panagg release / audit export
        #: (forced.py, export.py)
        self.requests = requests
        self.exports = exports
        self.audit_key_file, self.audit_dir = audit_key_file, audit_dir
        self.P = int(identity["partitions"])
        self.size = float(identity["window_size"])
        #: event-time windows: the closer writes their close markers; the windows are decided
        #: in order, and one no event fell in is not released (as one process skips it)
        self.closer = closer
        self.event_time = identity.get("window_kind", "time") == "event_time"
        #: count windows: the closer is a CountCloser (count_windows.py); like event-time
        #: windows they are decided in order, and one that got no event is not released
        self.count = identity.get("window_kind") == "count"
        self.window_kind = identity.get("window_kind", "time")
        #: windows that end at the closer's markers (no clock): decided in order, an empty one
        #: skipped, a late one timed from its first summary
        self.by_marker = self.event_time or self.count
        self._first_seen: dict[int, float] = {}
        self._skipped: set[int] = set()
        self._tp = TopicPartition(topics.summaries, 0)
        self.summaries = summaries
        summaries.assign([self._tp])
        summaries.seek_to_beginning(self._tp)
        self.pending: dict[int, dict[int, dict]] = {}
        self._in_flight = None  # (window, future)
        self._noticed: set[int] = set()
        #: partition -> the member whose summary of it was read last (named when one is late)
        self.last_member: dict[int, str] = {}
        self.released: list[dict] = []
        #: a views group's sum rollups (view_rollups.ViewRollups), set by the pipeline
        self.view_rollups = None
        #: sum rollups (rollups.RollupReleases), set by the pipeline when configured
        self.rollups = None
        #: release.max_in_flight: complete windows the leader may have queued before it says it
        #: is behind (``behind``: why, "" while it keeps up; the member's /ready reads it)
        self.max_in_flight = int(max_in_flight)
        self.behind = ""
        #: complete windows holding events not decided yet, as the last turn counted them
        self.queued = 0
        self._complete_at: dict[int, float] = {}

    # -- which windows are decided -----------------------------------------------------------
    def decided(self) -> set[int]:
        return {
            int(e["window"])
            for e in self.ledger.entries
            if e["kind"] in ("release", "refused") and e.get("window") is not None
        }

    def next_window(self) -> int:
        done = self.decided() | self._skipped
        if self.event_time and not done:
            # the first window is the closer's opening, not the identity's: the first summarized
            return min(self.pending) if self.pending else -1
        nxt = max(done) + 1 if done else int(self.identity["first_window"])
        if self.by_marker:
            # every partition summarizes the windows of a marker in order, so the first window
            # after the decided ones that has a summary is the next one
            later = [w for w in self.pending if w >= nxt]
            return min(later) if later else nxt
        return nxt

    # -- the loop's turn ---------------------------------------------------------------------
    def step(self) -> None:
        if self.requests is not None:
            self._force()
        if self.closer is not None:
            self.closer.step()
        if self.exports is not None:
            self._sign_exports()
        for records in self.summaries.poll(timeout_ms=0).values():
            for rec in records:
                if rec.value is None:
                    continue  # a tombstone
                if self.views and b"/c" in (rec.key or b""):
                    head, _, k = rec.key.decode().rpartition("/c")
                    self._chunks.setdefault(head, {})[int(k)] = rec.value
                    continue
                s = json.loads(rec.value)
                if self.views:
                    self._take_view(s, rec.key.decode())
                    continue
                if self.rollups is not None and self.rollups.take(s):
                    continue
                self.last_member[int(s["partition"])] = str(s.get("member", "?"))
                self.pending.setdefault(int(s["window"]), {})[int(s["partition"])] = s
                self._first_seen.setdefault(int(s["window"]), time.time())
        if self.rollups is not None:
            # (event-time windows without events are skipped, not ledgered: settled too)
            self.rollups.step(self.decided() | self._skipped)
        if self.view_rollups is not None:
            self.view_rollups.step(self.next_window())
        self._watch_queue()
        if self._in_flight is not None:
            w, fut = self._in_flight
            if not fut.done():
                return
            self._in_flight = None
            try:
                release = fut.result()
            except ValueError as exc:
                # summaries that do not make one window (they disagree, or a partition is
                # missing or twice): charged, never published, and the member keeps running
                self._withhold(w, self.pending.get(w, {}), f"its summaries cannot be merged: {exc}")
                return
            self._publish(w, release)
        w = self.next_window()
        for old in [k for k in self.pending if k < w]:
            self._tombstone_later(old)
        for old in [k for k in self._first_seen if k < w]:
            del self._first_seen[old]
        have = self.pending.get(w, {})
        if self.views and self.event_time:
            # a partition whose next view is of a later window had nothing of this one
            have = skipped_parts(w, self.pending, self.P, self._empty_part)
        self.metrics.windows_waiting.set(sum(1 for k in self.pending if k >= w))
        if len(have) < self.P:
            self._notice_waiting(w, have)
            return
        self.metrics.summaries_overdue.set(0)
        if self.views and self.requests is not None:
            eid = self.requests.export_of(w)
            if (
                eid is not None
                and eid not in self.exports.done
                and not self.ledger.has(f"export-{eid}")
            ):
                self._export_views(eid, w, have)
        if self.by_marker and not any(s.get("refused") or s.get("n") for s in have.values()):
            self._skip_empty(w, have)
            return
        refused = [have[p]["refused"] for p in sorted(have) if have[p].get("refused")]
        if w in self._twice:
            refused.append(self._twice.pop(w))
        if refused:
            # every partition's reason: each names its own lost or charged positions
            self._withhold(w, have, "; ".join(dict.fromkeys(refused)))
            return
        summaries = list({id(have[p]): have[p] for p in range(self.P)}.values())
        if self.merge is None:
            try:
                release = self.merge_fn(summaries, **self.merge_kwargs)
            except ValueError as exc:
                self._withhold(w, have, f"its summaries cannot be merged: {exc}")
                return
            self._publish(w, release)
        else:
            self._in_flight = (w, self.merge(summaries, **self.merge_kwargs))

    def _empty_part(self, w: int, p: int) -> dict:
        """Partition ``p``'s part of event-time window ``w`` where its member's next view says
        it had no event of it (no counters, no layer: event_views.py)."""

        head = view_header(
            None,
            window=w,
            covers=[p],
            partitions=self.P,
            window_info=window_info(w, self.identity),
            mode=self.identity["mode"],
            size=int(self.identity["size"]),
            params=state_params(self.identity),
        )
        head.update(ranges={}, member="", skipped=True)
        return head

    def _take_view(self, s: dict, key: str) -> None:
        """A member's view of window w: its chunks (read before it) attached, filed under every
        source partition it covers."""
        got = self._chunks.pop(key, {})
        if s.get("chunks") and sorted(got) != list(range(int(s["chunks"]))):
            # a transaction writes the chunks and the header together: missing ones were
            # removed under the view (a compaction of tombstoned keys): never merge a part
            s = dict(s, refused=f"the view of partitions {s.get('covers')} lost chunks")
        s["_chunks"] = [got[k] for k in sorted(got)]
        w = int(s["window"])
        held = self.pending.get(w, {})
        twice = sorted(
            int(p)
            for p in s["covers"]
            if int(p) in held and held[int(p)].get("uid") != s.get("uid")
        )
        if twice:
            # two committed views of one partition's window: never expected (each commit names
            # the generation its partitions were assigned in); both were written, so the window
            # is charged and withheld, never merged from one of them
            self._twice[w] = (
                f"partition(s) {', '.join(map(str, twice))} of window {w} were "
                f"viewed twice (by {held[twice[0]].get('member', '?')} and "
                f"{s.get('member', '?')})"
            )
        for p in s["covers"]:
            self.last_member[int(p)] = str(s.get("member", "?"))
            self.pending.setdefault(w, {})[int(p)] = s
        self._first_seen.setdefault(w, time.time())

    def _watch_queue(self) -> None:
        """The complete windows (every partition's summary in) not decided yet are the
        leader's release queue (``panagg_release_queue``). More than release.max_in_flight of
        them, or the oldest waiting longer than max_in_flight + 1 windows (time windows), means
        the release path is slower than the windows: one WARNING, ``behind`` set (the member's
        /ready answers 503) until the queue is down to max(1, max_in_flight // 2) windows (one
        INFO line). One process
        pauses its intake there; a group's intake runs on other members, so it is said, not
        paused (the queue lives in Kafka, not in memory)."""
        now = time.time()
        nxt = self.next_window()
        complete = sorted(k for k, have in self.pending.items() if k >= nxt and len(have) >= self.P)
        for k in complete:
            self._complete_at.setdefault(k, now)
        for k in [k for k in self._complete_at if k < nxt]:
            del self._complete_at[k]
        self.metrics.release_queue.set(len(complete))
        self.queued = sum(1 for k in complete if _holds_events(self.pending[k]))
        waited = now - self._complete_at[complete[0]] if complete else 0.0
        bound = None if self.count else (self.max_in_flight + 1) * self.size
        if len(complete) > self.max_in_flight:
            reason = (
                f"the leader is behind: {len(complete)} complete windows wait for their "
                f"release (release.max_in_flight = {self.max_in_flight})"
            )
        elif bound is not None and waited > bound:
            reason = (
                f"the leader is behind: window {complete[0]} has waited {waited:.0f} s "
                f"for its release (more than release.max_in_flight + 1 windows)"
            )
        elif self.behind and len(complete) > max(1, self.max_in_flight // 2):
            # back to ready only well within the bound: at the edge it would flap with each
            # window that closes (seen: behind, caught up, behind again within a second)
            reason = self.behind
        else:
            reason = ""
        if reason and not self.behind:
            log.warning(
                "%s; the release path is slower than the windows (a faster "
                "release.estimator, release.error_bar_reps = 0 or longer windows help)",
                reason,
            )
        elif self.behind and not reason:
            log.info(
                "the leader caught up: %d complete window(s) wait for their release", len(complete)
            )
        self.behind = reason

    @property
    def busy(self) -> bool:
        """A window holding events is being released or waits complete for its release: a
        member that leads is not idle (``--exit-when-idle``) while its leader has such work,
        which its own intake does not show (a slow release path drains after the last event
        was counted). Empty windows do not count: time windows keep closing without events,
        and a release path slower than they are would never let the member go."""
        if self._in_flight is not None and _holds_events(self.pending.get(self._in_flight[0], {})):
            return True
        return self.queued > 0

    def _force(self) -> None:
        """A forced release asked for (``panagg release``): close markers for window K in
        every partition, the answer, one transaction (forced.py)."""

        asked = self.requests.pending()
        if asked is None:
            return
        kind, rid = asked
        error = ""
        if self.event_time and kind == "release" and self.closer is not None:
            self._force_event_time(rid)
            return
        if self.views and self.event_time and kind == "export":
            self._refuse_request(
                kind,
                rid,
                "audit exports of a group with event-time windows "
                "and scale.exchange = views are not built yet: a member holds "
                "several open windows; docs/scale-out.md",
            )
            return
        if self.views and self.event_time and self.requests.newest_ms is None:
            self._refuse_request(
                kind,
                rid,
                "the group's event-time windows have not opened "
                "yet (no records read): nothing to release",
            )
            return
        if kind == "export" and (self.views or not self.event_time):
            try:
                load_key(self.audit_key_file or None)
            except AuditKeyError as exc:  # said to the asker; nothing closes
                error = (
                    f"the group's leader cannot sign the export: {exc}. The key is read "
                    "by the members (their environment or audit.key_file), not by this "
                    "shell: set it there and restart them"
                )
        if self.views and not error:
            if self.count:
                # every member's open window is at most one past the views written: the
                # latest of them closes (count_views.py), the next counts N from the cut
                k = max(self.next_window(), max(self.pending, default=-1) + 1)
            elif self.event_time:
                # the window of the newest timestamp read: every record read so far is in it
                # or before it; later records of those windows are late (event_views.py)
                k = int(self.requests.newest_ms // int(round(self.size * 1000)))
            else:
                k = forced_window(self.size, self.next_window())
            try:
                self.requests.answer_views(self.txn, rid, k, kind=kind)
            except KafkaError as exc:
                self.txn.failed(exc)
                raise
            log.info(
                "%s: window %d%s closes now at every member (close record written)",
                "forced release" if kind == "release" else f"audit export {rid[:8]}",
                k,
                f" of {self.aggregation}" if self.aggregation else "",
            )
            return
        if self.event_time and not error:
            # an export closes its partition's open window, and a partition here holds several
            error = (
                "audit exports of a group with event-time windows are not built yet: a "
                "partition holds several live windows (one process refuses that too); "
                "docs/scale-out.md"
            )
        if self.count and not error:
            self._force_count(kind, rid)
            return
        k = None if error else forced_window(self.size, self.next_window())
        try:
            self.requests.answer(self.txn, kind, rid, k, self.P, error=error)
        except KafkaError as exc:
            self.txn.failed(exc)
            raise
        if error:
            log.error("audit export %s refused: %s", rid[:8], error)
            return
        log.info(
            "%s: window %d%s closes now in every partition (markers written)",
            "audit export" if kind == "export" else "forced release",
            k,
            f" of {self.aggregation}" if self.aggregation else "",
        )

    def _force_event_time(self, rid: str) -> None:
        """A forced release of an event-time group: the closer closes every window up to the
        newest one seen, the answer in its transaction."""
        k = self.closer.force(
            lambda txn, upto: self.requests.send_answer(txn, "release", rid, upto)
        )
        if k is not None:
            self.requests.answered("release", rid)
            return
        self._refuse_request(
            "release",
            rid,
            "the group's event-time windows have not opened "
            "yet (no records read): nothing to release",
        )

    def _refuse_request(self, kind: str, rid: str, error: str) -> None:
        """Answer a forced release or export with ``error`` alone (nothing closes)."""

        try:
            self.requests.answer(self.txn, kind, rid, None, self.P, error=error)
        except KafkaError as exc:
            self.txn.failed(exc)
            raise

    def _force_count(self, kind: str, rid: str) -> None:
        """A forced release or an export of a count-window group: the count closer cuts the
        open window now, the answer in its transaction (count_windows.py)."""
        closer = self.closer
        closer.read()
        if kind == "release" and closer.total == closer.cut_at:
            # an empty window is not released (as one process has nothing to release)
            self._refuse_request(
                "release", rid, "the open count window holds no events yet: nothing to release"
            )
            return
        closer.force(
            lambda txn, k: self.requests.send_answer(txn, kind, rid, k),
            export_id=rid if kind == "export" else None,
        )
        self.requests.answered(kind, rid)

    def _export_views(self, eid: str, w: int, have: dict) -> None:
        """An audit export of a views group: window ``w``'s views summed into one state (the
        counters its release is computed from: post-processing, no layer drawn), signed; the
        ledger entry (0 eps) and the document in one transaction, then the local file."""

        ident = self.identity
        state = PanPrivateHistogram(
            ident["epsilon"], neighbor=ident["neighbor"], size=int(ident["size"])
        )
        state._counts, state._layers, state._n = sum_views(distinct_views(have), int(ident["size"]))
        window = {
            "id": w,
            "windows": [w],
            "partitions": self.P,
            "group": self.topics.group,
            "aggregation": self.aggregation or None,
            "exchange": "views",
        }
        self._ledger_export(
            eid,
            state,
            window,
            self._ranges(have),
            note="announced export of a views group's window: the sum of its "
            "members' views, the counters its release is computed from "
            "(post-processing, no layer drawn)",
        )

    def _sign_exports(self) -> None:
        """Exports whose P slices are in: one state, signed; ledger entry, document and slice
        tombstones in one transaction; then the local file (export.py)."""

        for eid, slices in self.exports.complete():
            state = assemble(slices)
            windows = sorted({int(s["window"]) for s in slices})
            ranges = {f"{self.topics.repartition}:{s['partition']}": s["range"] for s in slices}
            window = {
                "id": windows[0],
                "windows": windows,
                "partitions": self.P,
                "group": self.topics.group,
                "aggregation": self.aggregation or None,
            }
            self._ledger_export(
                eid,
                state,
                window,
                ranges,
                note="announced export of every partition's open window; fresh DLap layers "
                "before and after; each window closed with its slice",
                tombstones=[f"slice/{eid}/{s['partition']}".encode() for s in slices],
            )
            self.exports.slices.pop(eid, None)

    def _ledger_export(
        self, eid: str, state, window: dict, ranges: dict, *, note: str, tombstones=()
    ) -> None:
        """Sign ``state`` as export ``eid``; its ledger entry (0 eps), the document and the
        exports topic's ``tombstones`` in one transaction; then the local file (only once the
        export is ledgered, like one process's)."""

        doc = signed_export(
            state=state.serialize(),
            window=window,
            offsets=ranges,
            export_id=eid,
            key=load_key(self.audit_key_file or None),
        )
        txn = self.txn
        try:
            txn.begin()
            self.ledger.append(
                entry_id=f"export-{eid}",
                kind="export",
                window=window["id"],
                epsilon_spent=0.0,
                model=self.identity["model"],
                note=note,
                producer=txn,
                ranges=ranges,
            )
            txn.send(self.topics.exports, partition=0, key=f"doc/{eid}".encode(), value=doc)
            for key in tombstones:
                txn.send(self.topics.exports, partition=0, key=key, value=None)
            txn.commit()
        except KafkaError as exc:
            self.ledger.aborted()
            txn.failed(exc)
            raise
        self.ledger.committed()
        path = save_export(Path(self.audit_dir) / f"export-{eid}.panagg", doc)
        self.exports.done.add(eid)
        self.metrics.exports.inc()
        log.info(
            "audit export %s of window(s) %s signed (%d layers): %s and %s",
            eid[:8],
            ", ".join(map(str, window["windows"])),
            state.layers,
            path,
            self.topics.exports,
        )

    def _skip_empty(self, w: int, have: dict) -> None:
        """An event-time or count window no event fell in (noise-only summaries): not released,
        nothing charged; its summaries are removed."""
        txn = self.txn
        try:
            txn.begin()
            for key in _summary_keys(w, have):
                txn.send(self.topics.summaries, partition=0, key=key, value=None)
            txn.commit()
        except Exception as exc:
            txn.failed(exc)
            raise
        self.pending.pop(w, None)
        self._skipped.add(w)

    def _notice_waiting(self, w: int, have: dict) -> None:
        # an event-time window's end is in the records' time: count from its first summary
        due = (
            self._first_seen.get(w, time.time())
            if self.by_marker
            else (w + 1) * self.size + self.grace_s
        )
        late = time.time() - due
        if late < WAIT_NOTICE_S:
            self.metrics.summaries_overdue.set(0)
            return
        missing = sorted(set(range(self.P)) - set(have))
        self.metrics.summaries_overdue.set(len(missing))
        if w in self._noticed:
            return
        self._noticed.add(w)
        named = ", ".join(
            f"{p} (last summarized by {self.last_member[p]})" if p in self.last_member else str(p)
            for p in missing
        )
        log.warning(
            "window %d waits for the summaries of partition(s) %s of %s, %.0f s after "
            "%s: that member is stopped, stuck or gone (the group moves its "
            "partitions after source.session_timeout_s)",
            w,
            named,
            self.counted_topic,
            late + (0 if self.by_marker else self.grace_s),
            "its first summary" if self.by_marker else "its end",
        )

    @staticmethod
    def _ranges(have: dict) -> dict:
        out = {}
        for s in have.values():
            out.update(s["ranges"])
        return out

    # -- deciding a window -------------------------------------------------------------------
    def _entry_fields(self, w: int, have: dict) -> dict:
        fields = {
            "window_uid": f"{self.identity['lineage']}/{w}",
            "ranges": self._ranges(have),
            "lineage": self.identity["lineage"],
            "window_kind": self.window_kind,
            "partitions": self.P,
        }
        if not self.views:
            # the items exchange ledgers repartition positions; the budget registry is keyed
            # by source positions, which the summaries carry (intake -> counter)
            fields["sources"] = source_ranges(have.values())
        return fields

    @staticmethod
    def _registry_ranges(entry: dict) -> dict:
        """The source positions an entry charges in the budget registry."""
        return entry["sources"] if "sources" in entry else entry["ranges"]

    def _withhold(self, w: int, have: dict, reason: str) -> None:
        # (a view refused with ``charge``, a window whose snapshot cannot be resumed: its
        # snapshots were views of its events, so its positions are charged: views.py)
        seen = {p: s for p, s in have.items() if not s.get("refused") or s.get("charge")}
        fields = self._entry_fields(w, seen)
        # the positions of the refused parts (not charged: no view of them was drawn), so
        # that the entry names every position it withholds (issue 46)
        unseen = self._ranges({p: s for p, s in have.items() if p not in seen})
        if unseen:
            fields["withheld_ranges"] = unseen
        log.warning("window %d is withheld: %s; nothing of it is published", w, reason)
        self._transact(
            w,
            have,
            entry=dict(
                kind="release",
                window=w,
                epsilon_spent=float(self.identity["epsilon"]) if seen else 0.0,
                withheld=reason,
                **fields,
            ),
            document=None,
        )
        self.metrics.releases_refused.inc()

    def _publish(self, w: int, release: dict) -> None:
        have = self.pending.get(w, {})
        fields = self._entry_fields(w, have)
        eps = float(self.identity["epsilon"])
        try:
            self.ledger.check_release(
                fields["window_uid"],
                eps,
                window=w,
                ranges=fields["ranges"],
                lineage=fields["lineage"],
                window_kind=self.window_kind,
            )
            if self.registry is not None:
                self._check_registry(w, fields, eps)
        except BudgetExceeded as exc:
            # the summaries were written, so the window was seen: charged, not published
            self._withhold(w, have, str(exc))
            return
        if self.aggregation:
            release["aggregation"] = {"name": self.aggregation}
        if self.rollup_level:
            release["rollup_level"] = dict(self.rollup_level)
        release["window_uid"] = fields["window_uid"]
        release["ranges"] = fields["ranges"]
        release["scale_out"] = {
            "store": "kafka",
            "partitions": self.P,
            "exchange": "views" if self.views else "items",
            "members": sorted({s.get("member", "") for s in have.values()}),
        }
        stamp_window(release)
        doc = json.dumps(release, allow_nan=False, sort_keys=True)
        entry = dict(
            kind="release",
            window=w,
            epsilon_spent=eps,
            model=self.identity["model"],
            n=int(release["n"]),
            document_sha256=hashlib.sha256(doc.encode()).hexdigest(),
            **fields,
        )
        folded, apply = (
            ([], None)
            if self.view_rollups is None
            else self.view_rollups.fold(w, fields["window_uid"], have)
        )
        if not self._transact(w, have, entry=entry, document=doc, extra=folded):
            return
        if apply is not None:
            apply()
        self.released.append(release)
        path = self.local_file(release, f"release of window {w}")
        self.metrics.releases.inc()
        self.metrics.last_release.set(time.time())
        ended = (release.get("window_info") or {}).get("ended_unix")
        if ended is not None:  # window end -> merged release published, as docs/operations.md
            self.metrics.release_latency.observe(max(0.0, time.time() - float(ended)))
        self.metrics.published(release)
        log.info(
            "published release of %swindow %d: n=%d over %d partitions -> %s",
            f"{self.aggregation} " if self.aggregation else "",
            w,
            release["n"],
            self.P,
            path or self.topics.releases,
        )

    def _known(self) -> set[tuple[str, str]]:
        lid = ledger_id(self.ledger.entries)
        return {(lid, e["id"]) for e in self.ledger.entries}

    def _check_registry(self, w: int, fields: dict, eps: float) -> None:
        """BudgetExceeded naming the other deployment when the registry's charges (another
        deployment's, or this ledger's that it lost) bring the window's events over budget."""
        started = time.perf_counter()
        try:
            self.registry.read_to_end()
        except RegistryError as exc:
            # (a Kafka error goes up: the leader's turn is lost and tried again)
            log.warning("%s; window %d is checked against the group's ledger only", exc, w)
        try:
            check_registry(
                self.registry,
                self.ledger,
                self._known(),
                fields["window_uid"],
                eps,
                window=w,
                ranges=self._registry_ranges(fields),
                lineage=fields["lineage"],
                window_kind=self.window_kind,
            )
        finally:  # a refusal's check took its time too
            self.metrics.registry_check.observe(time.perf_counter() - started)

    def local_file(self, release: dict, what: str) -> str | None:
        """The release's file in ``release.dir`` once its document is in Kafka (None: the
        write failed, said in one line; the local file is a convenience)."""
        try:
            return write_release(release, self.release_dir, plot=False)
        except OSError as exc:
            log.warning(
                "%s is in %s but its local file failed (%s)",
                what,
                self.topics.releases,
                exc.strerror,
            )
            return None

    def release_key(self, name: str) -> str:
        """The record key on ``release.topic``: as one process keys it, the window (or rollup)
        name, prefixed ``NAME/`` with several aggregations. The aggregations share the topic,
        so on a compacted one a bare window number would keep one aggregation's release."""
        return f"{self.aggregation}/{name}" if self.aggregation else name

    def _transact(self, w: int, have: dict, *, entry: dict, document: str | None, extra=()) -> bool:
        txn = self.txn
        try:
            txn.begin()
            self.ledger.append(entry_id=f"{self.identity['lineage']}/{w}", producer=txn, **entry)
            if self.registry is not None:
                # the charge, in the transaction of its ledger entry
                msg = self.registry.message(
                    ledger_id(self.ledger.entries),
                    dict(
                        entry,
                        id=f"{self.identity['lineage']}/{w}",
                        ranges=self._registry_ranges(entry),
                    ),
                )
                if msg is not None:
                    txn.send(self.registry.topic, partition=0, key=msg[0], value=msg[1])
            if document is not None:
                txn.send(
                    self.topics.releases, partition=0, key=str(w).encode(), value=document.encode()
                )
                if self.release_topic:
                    txn.send(
                        self.release_topic,
                        key=self.release_key(str(w)).encode(),
                        value=document.encode(),
                    )
            for key in _summary_keys(w, have):
                txn.send(self.topics.summaries, partition=0, key=key, value=None)
            for topic, key, value in extra:  # rollup sums (view_rollups.py)
                txn.send(topic, partition=0, key=key, value=value)
            txn.commit()
        except KafkaError as exc:
            log.warning("window %d not decided (%s); it is tried again", w, type(exc).__name__)
            self.ledger.aborted()
            txn.failed(exc)
            raise
        self.ledger.committed()
        # the budget gauges, as one process shows them (the budget alerts read them)
        self.metrics.budget(self.ledger.spent(), self.ledger.remaining())
        self.pending.pop(w, None)
        return True

    def _tombstone_later(self, w: int) -> None:
        """Summaries of a window decided before (a leader died after the ledger entry): they
        are removed with the next decision's transaction."""
        have = self.pending.pop(w, {})
        if not have:
            return
        self.txn.begin()
        for key in _summary_keys(w, have):
            self.txn.send(self.topics.summaries, partition=0, key=key, value=None)
        self.txn.commit()
