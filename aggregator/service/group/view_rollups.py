"""Sum rollups (``window.rollups``, ``rollup_design = sum``) of a views group, kept by its leader.

A rollup of k base windows is the sum of their release views (docs/rollups.md). In a views group
the release of window w is computed from the sum of the members' views of w (``merge_views``),
so that sum *is* w's release view: the leader adds it to the running sum of each rollup holding
w, in the transaction of w's ledger entry. The sums live in ``<prefix>.rollups`` (one
partition, compacted, key ``<span>/<index>``, zlib of :meth:`RollupSum.to_bytes`); a new leader
reads them back as of the last decided window, so each released window is added exactly once.
A withheld window is not added (its views are not a release): the rollup names it as missing,
as one process does.

Once a window at or past a rollup's last base window is decided, the rollup is released from its
sum (through the same merge as a window: the estimators told how many layers it holds) and, in
one transaction, the ledger gets its entry (0 eps: post-processing of released views, docs/
privacy.md section 21), the document goes to the releases topics and the sum is tombstoned.

>>> import numpy as np
>>> from aggregator.state import PanPrivateHistogram
>>> from .view_format import decode_view, distinct_views, sum_views, view_header
>>> s = PanPrivateHistogram(1.0, size=4)
>>> s.add_indices(np.array([0, 0, 3]))
>>> info = {"kind": "time", "size": 5.0, "events": 3, "started_unix": 0.0, "ended_unix": 5.0}
>>> v = view_header(s, window=7, covers=[0, 1], partitions=2, window_info=info)
>>> have = {0: v, 1: v}
>>> r = RollupSum("3x", 2, windows=3, p=s.p, mode="direct", size=4)
>>> counts, layers, n = sum_views(distinct_views(have), 4)   # one view, filed twice
>>> r.update("L/7", 7, counts, layers=layers, n=n)
True
>>> r.layers, r.n, r.covered(), bool(np.array_equal(r.counts, decode_view(v)))
(2, 3, [7], True)
>>> merged = rollup_view(r, partitions=2, params=s, window_info=info)
>>> merged["layers"], merged["n"], merged["covers"], merged["window"]
(2, 3, [0, 1], '3x-2')
"""

from __future__ import annotations

import copy
import logging
import zlib

from kafka import TopicPartition

from ..rollup import RollupError, RollupSum
from .rollups import publish_rollup, rollup_window_size, transact_rollup
from .topics import read_partition
from .view_format import VIEW_FORMAT, distinct_views, encode_counts, state_params, sum_views

__all__ = ["ViewRollups", "rollup_view"]

log = logging.getLogger("panagg.group")


def rollup_view(
    r: RollupSum, *, partitions: int, params, window_info: dict, mode: str = "direct"
) -> dict:
    """The rollup's sum as one view covering every partition, for ``merge_views``."""
    dtype, chunks = encode_counts(r.counts)
    return {
        "format": VIEW_FORMAT,
        "version": 1,
        "window": f"{r.span}-{r.index}",
        "partition": 0,
        "covers": list(range(int(partitions))),
        "partitions": int(partitions),
        "mode": str(mode),
        "size": int(r.size),
        "epsilon": params.epsilon,
        "neighbor": params.neighbor,
        "p": params.p,
        "model": "joint",
        "window_info": dict(window_info),
        "layers": int(r.layers),
        "n": int(r.n or 0),
        "chunks": len(chunks) if r.layers else 0,
        "dtype": dtype,
        "_chunks": chunks if r.layers else [],
    }


class ViewRollups:
    """The leader's running sums of a views group's rollups, and their releases.

    ``leader`` is the :class:`~aggregator.service.group.leader.Leader`; ``spans`` {name: base
    windows}; ``reader`` a consumer with no group (read committed) for the restore."""

    def __init__(self, leader, spans: dict[str, int], reader):
        self.leader, self.spans = leader, dict(spans)
        self.sums: dict[tuple[str, int], RollupSum] = {}
        self._in_flight = None  # ((span, idx), future)
        tp = TopicPartition(leader.topics.rollups, 0)
        reader.assign([tp])
        reader.seek_to_beginning(tp)

        def take(rec):
            span, _, idx = rec.key.decode().partition("/")
            if rec.value is None:
                self.sums.pop((span, int(idx)), None)
            else:
                self.sums[(span, int(idx))] = RollupSum.from_bytes(zlib.decompress(rec.value))

        if not read_partition(reader, tp, take):
            raise RollupError(
                f"the rollup sums in {leader.topics.rollups} could not be read "
                "to their end; the leader tries again"
            )
        self.reader = reader
        if self.sums:
            log.info(
                "%d open rollup sum(s) read back from %s (%s)",
                len(self.sums),
                leader.topics.rollups,
                ", ".join(f"{s}-{i}" for s, i in sorted(self.sums)),
            )

    # -- in the window's transaction -----------------------------------------------------------
    def fold(self, w: int, uid: str, have: dict) -> tuple[list[tuple], object]:
        """Messages (topic, key, value) adding window ``w`` to each rollup holding it, for the
        transaction of its ledger entry, and what to apply once it is committed."""
        ident = self.leader.identity
        counts, layers, n = sum_views(distinct_views(have), int(ident["size"]))
        new = {}
        for span, k in self.spans.items():
            idx = w // k
            r = self.sums.get((span, idx))
            r = (
                copy.deepcopy(r)
                if r is not None
                else RollupSum(
                    span,
                    idx,
                    windows=k,
                    p=state_params(ident).p,
                    mode=ident["mode"],
                    size=int(ident["size"]),
                )
            )
            # (a window no member counted an event in adds no counter and no layer: its release
            # drew two layers of its own, noise alone)
            r.update(uid, w, counts, layers=layers, n=n)
            new[(span, idx)] = r
        msgs = [
            (self.leader.topics.rollups, f"{span}/{idx}".encode(), zlib.compress(r.to_bytes(), 1))
            for (span, idx), r in new.items()
        ]
        return msgs, lambda: self.sums.update(new)

    # -- releasing the rollups whose windows are all decided ----------------------------------
    def step(self, decided_below: int) -> None:
        """Release the rollups whose last base window is below ``decided_below`` (the next
        window the leader decides), one at a time, beside the loop when a worker exists."""
        lead = self.leader
        if self._in_flight is not None:
            key, fut = self._in_flight
            if not fut.done():
                return
            self._in_flight = None
            self._publish(key, fut.result())
        for key in sorted(self.sums, key=lambda t: (t[1], t[0])):
            span, idx = key
            last = (idx + 1) * self.spans.get(span, 0) - 1
            if span not in self.spans or last >= decided_below:
                continue
            r = self.sums[key]
            rid = f"{lead.identity['lineage']}/rollup-{span}-{idx}"
            if lead.ledger.has(rid) or not r.parts:  # decided before, or nothing released
                self._transact(key, entry=None, document=None)
                continue
            first = min(int(v["window"]) for v in r.parts.values())
            size = float(lead.identity["window_size"])
            info = {
                "kind": "rollup",
                "size": rollup_window_size(lead.identity, r.windows),
                "events": int(r.n or 0),
                "started_unix": first * size,
                "ended_unix": (last + 1) * size,
            }
            view = rollup_view(
                r,
                partitions=lead.P,
                params=state_params(lead.identity),
                window_info=info,
                mode=lead.identity["mode"],
            )
            if lead.merge is None:
                self._publish(key, lead.merge_fn([view], **lead.merge_kwargs))
            else:  # beside the loop: a week of 1e6 counters takes a while
                self._in_flight = (key, lead.merge([view], **lead.merge_kwargs))
                return

    def _missing(self, r: RollupSum) -> list[dict]:
        lead = self.leader
        out = []
        for w in r.missing():
            e = lead.ledger.get(f"{lead.identity['lineage']}/{w}")
            if e is not None and e.get("withheld"):
                why = f"withheld by the ledger ({e['withheld']})"
            elif w < int(lead.identity["first_window"]):
                why = "not counted by this group (before its first window)"
            elif lead.by_marker:
                why = "no event fell in it (not released)"
            else:
                why = "withheld by the ledger: it has no release"
            out.append({"window": w, "why": why})
        return out

    def _publish(self, key: tuple[str, int], release: dict) -> None:
        lead = self.leader
        span, idx = key
        r = self.sums[key]
        entries = [
            e
            for e in (
                lead.ledger.get(uid)
                for uid in sorted(r.parts, key=lambda u: int(r.parts[u]["window"]))
            )
            if e is not None
        ]
        publish_rollup(
            lead,
            r,
            entries,
            self._missing(r),
            release,
            scale_out={"store": "kafka", "partitions": lead.P, "exchange": "views"},
            tombstones=[(lead.topics.rollups, f"{span}/{idx}".encode())],
        )
        self.sums.pop(key, None)

    def _transact(self, key, *, entry: dict | None, document: str | None) -> None:
        """Decide a rollup with nothing to publish: its sum's tombstone (and ``entry``)."""
        span, idx = key
        transact_rollup(
            self.leader,
            f"{span}-{idx}",
            entry=entry,
            document=document,
            tombstones=[(self.leader.topics.rollups, f"{span}/{idx}".encode())],
        )
        self.sums.pop(key, None)
