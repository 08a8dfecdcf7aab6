"""Sum rollups (``window.rollups``, ``rollup_design = sum``) in a Kafka-only group.

A rollup of k base windows is the sum of their release views (docs/rollups.md). In a group the
view of window w is the P slices' layered counters, one per partition, each the counters its
window summary was taken from (:func:`~aggregator.service.group.summary.partition_summary`
hands that very array over: a second draw of the release layer would be a second view).

Counting (:class:`SliceRollups`). Partition p keeps, per span, the running
:class:`~aggregator.service.rollup.RollupSum` of ITS slice's views. Closing window w, in the same
transaction as w's summary and the partition's offset, it writes the updated sum to
``<prefix>.rollups`` (partition p, key ``<span>/<index>``, compacted). When w is the rollup's
last base window it writes instead the rollup's summary (value counts of the summed slice, its
layers, n and the base windows it holds) to the summaries topic (key ``r/<span>/<index>/<p>``)
and tombstones the sum. A new owner of p (a rebalance, a kill -9) restores p's sums from the
topic: they are exactly as of p's committed offset (one transaction), so a window replayed
from there is added once.

Leading (:class:`RollupReleases`). Once the P rollup summaries are in and every base window
they hold is decided, the leader asks the ledger about each: a rollup may only hold windows the
group RELEASED. A window whose slices some partition holds and that was withheld (a partition
refused it, a lost snapshot) makes the whole rollup withheld (``refused-rollup``, nothing
published): the other partitions' slices of it are in their sums and a sum cannot be taken
apart. Windows no partition holds are named as missing, as one process names them. Otherwise
the summaries merge like a window's (partitions holding more layers, after an audit export, are
evened out with fresh layers) and, in one transaction, the ledger gets the rollup entry (0 eps,
the argument, the base windows' entries), the document goes to the releases topics and the
rollup summaries are tombstoned; then the local file, metrics and log.

>>> import json
>>> from aggregator.state import PanPrivateHistogram
>>> s = PanPrivateHistogram(1.0, size=3)
>>> ident = {"lineage": "L", "model": "joint", "window_size": 2.0, "partitions": 1}
>>> rolls = SliceRollups({"3x": 3}, None, ident)
>>> rolls.sums[0] = {}
>>> msgs, apply = rolls.fold(0, 4, (s.counts + 1, 2), state=s, events=5, member="m")
>>> [(topic, key) for topic, _, key, _ in msgs], apply()
([('rollups', b'3x/1')], None)
>>> msgs, apply = rolls.fold(0, 5, None, state=s, events=0, member="m")  # w5 refused: last
>>> [key for _, _, key, _ in msgs], rolls.sums[0]["3x"].covered()   # applied at the commit
([b'r/3x/1/0', b'3x/1'], [4])
>>> json.loads(msgs[0][3])["parts"]["L/4"]["layers"], msgs[1][3]    # summary; tombstone
(2, None)
>>> apply(); rolls.sums[0]
{}
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from types import SimpleNamespace

from kafka import TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError

from ...release import stamp_window
from ..errors import ServiceError
from ..rollup import ROLLUP_ARGUMENT, RollupError, RollupSum, missing_caveat, rollup_block
from .summary import merge_summaries, view_summary
from .topics import read_partition

__all__ = [
    "SliceRollups",
    "RollupReleases",
    "judge_rollup",
    "rollup_window_size",
    "publish_rollup",
    "transact_rollup",
]

log = logging.getLogger("panagg.group")


def rollup_window_size(identity: dict, windows: int):
    """The length of ``windows`` base windows (seconds, as one process's k_size)."""
    size = float(identity["window_size"])
    return int(size) * windows if size.is_integer() else size * windows


# -- counting: each partition's running sums ------------------------------------------------------
class SliceRollups:
    """The open rollup sums of the partitions this member counts.

    ``spans`` {name: base windows}; ``topics`` the aggregation's GroupTopics; ``reader`` a
    consumer without group (read committed) for restores.
    """

    #: the largest slice whose sum fits a member's producer request (16 MB, 8 bytes a counter)
    MAX_SLICE = 2_000_000

    def __init__(self, spans: dict[str, int], topics, identity: dict, reader=None):
        self.spans, self.topics, self.identity = dict(spans), topics, identity
        P = int(identity["partitions"])
        if "size" in identity and -(-int(identity["size"]) // P) > self.MAX_SLICE:
            need = -(-int(identity["size"]) // self.MAX_SLICE)
            raise ServiceError(
                f"window.rollups as sums keep each partition's slice of "
                f"{-(-int(identity['size']) // P)} counters in one Kafka message, "
                f"more than the {self.MAX_SLICE} that fit 16 MB; use at least "
                f"{need} partitions (scale.partitions) for a new group, or "
                "window.rollup_design = tree"
            )
        self.reader = reader
        #: partition -> {span: the open RollupSum}
        self.sums: dict[int, dict[str, RollupSum]] = {}
        # names in messages: the topics, or plain names in a doctest
        self._rollups = topics.rollups if topics is not None else "rollups"
        self._summaries = topics.summaries if topics is not None else "summaries"

    def restore(self, partition: int) -> None:
        """Partition ``partition``'s sums as of its committed offset (the sums and the offset
        are written in one transaction)."""

        tp = TopicPartition(self._rollups, partition)
        self.reader.assign([tp])
        self.reader.seek_to_beginning(tp)
        latest: dict[bytes, bytes | None] = {}
        if not read_partition(self.reader, tp, lambda rec: latest.__setitem__(rec.key, rec.value)):
            raise KafkaTimeoutError(f"{self._rollups} partition {partition} not read to its end")
        sums = {}
        for key, value in latest.items():
            if value is None:
                continue
            try:
                r = RollupSum.from_bytes(value)
            except RollupError as exc:
                raise ServiceError(
                    f"{self._rollups} partition {partition}, key {key!r}: {exc}; "
                    "write a tombstone for that key (the rollup is then not "
                    "released) or restore the topic"
                ) from None
            if r.span in self.spans:
                sums[r.span] = r
        self.sums[partition] = sums
        if sums:
            log.info(
                "partition %d resumes rollup sum(s) %s from %s",
                partition,
                ", ".join(f"{r.span}-{r.index} ({len(r.parts)} windows)" for r in sums.values()),
                self._rollups,
            )

    def drop(self, partition: int) -> None:
        self.sums.pop(partition, None)

    def fold(
        self,
        partition: int,
        window: int,
        view,
        *,
        state,
        events: int,
        member: str,
        times: tuple[float, float] | None = None,
    ):
        """Closing ``window`` of ``partition``: its release view ``view`` = (counters, layers)
        (None: refused, no view) added to each span's sum. Returns the messages for the close's
        transaction, (topic, partition, key, value), and ``apply()`` to call once it committed."""
        mine = self.sums.get(partition, {})
        after: dict[str, RollupSum] = {}
        msgs = []
        uid = f"{self.identity['lineage']}/{window}"
        for span, k in self.spans.items():
            idx = window // k
            r = mine.get(span)
            if r is not None and r.index != idx:
                # (every window of a partition closes in order, so the last base window of
                # r closed it; a sum left behind is a bug's: said, not summed on)
                log.error(
                    "partition %d: rollup sum %s-%d outlived its last window; dropped",
                    partition,
                    span,
                    r.index,
                )
                msgs.append((self._rollups, partition, f"{span}/{r.index}".encode(), None))
                r = None
            r = (
                copy.deepcopy(r)
                if r is not None
                else RollupSum(span, idx, windows=k, p=state.p, mode=state.mode, size=state.size)
            )
            if view is not None and r.update(uid, window, view[0], layers=view[1], n=int(state.n)):
                # (``times``: the window's own, where its number does not give them: count windows)
                size = float(self.identity["window_size"])
                start, end = times or (window * size, (window + 1) * size)
                r.parts[uid].update(events=int(events), started_unix=start, ended_unix=end)
            key = f"{span}/{idx}".encode()
            if window == (idx + 1) * k - 1:
                summary = self._summary(r, partition, state, member)
                msgs.append(
                    (
                        self._summaries,
                        0,
                        f"r/{span}/{idx}/{partition}".encode(),
                        json.dumps(summary, allow_nan=False).encode(),
                    )
                )
                msgs.append((self._rollups, partition, key, None))
            else:
                msgs.append((self._rollups, partition, key, r.to_bytes()))
                after[span] = r

        def apply() -> None:
            self.sums[partition] = after

        return msgs, apply

    def _summary(self, r: RollupSum, partition: int, state, member: str) -> dict:
        parts = list(r.parts.values())
        size = float(self.identity["window_size"])
        first, last = r.index * r.windows, (r.index + 1) * r.windows
        info = {
            "kind": "rollup",
            "size": rollup_window_size(self.identity, r.windows),
            "events": int(sum(v.get("events", 0) for v in parts)),
            "started_unix": min((v["started_unix"] for v in parts), default=first * size),
            "ended_unix": max((v["ended_unix"] for v in parts), default=last * size),
        }
        params = SimpleNamespace(
            mode=state.mode,
            size=state.size,
            epsilon=state.epsilon,
            neighbor=state.neighbor,
            p=state.p,
        )
        out = view_summary(
            r.counts,
            layers=r.layers,
            model=self.identity["model"],
            window=f"{r.span}-{r.index}",
            partition=partition,
            partitions=int(self.identity["partitions"]),
            window_info=info,
            n=r.n or 0,
            params=params,
        )
        out.update(rollup=r.span, index=r.index, windows=r.windows, parts=r.parts, member=member)
        return out


# -- leading: the ledger's answer and the release ---------------------------------------------
def noise_only_windows(have: dict[int, dict], ledger, P: int) -> set[str]:
    """The uids of the base windows that are in all P partitions' sums with no event in any and
    have no ledger entry: event-time windows no event fell in (skipped, never released), their
    views noise alone."""
    out = set()
    for uid in {u for s in have.values() for u in s["parts"]}:
        parts = [s["parts"].get(uid) for s in have.values()]
        if (
            len(parts) == P
            and all(x is not None and not x.get("events") for x in parts)
            and ledger.get(uid) is None
        ):
            out.add(uid)
    return out


def judge_rollup(have: dict[int, dict], ledger, identity: dict) -> tuple[str | None, list, list]:
    """The ledger's answer for a rollup from its P partition summaries ``have``: ``(reason,
    entries, missing)``; ``reason`` is None when it may be published over the base windows'
    ledger ``entries`` (window order), naming the ``missing`` ones ({"window", "why"})."""
    P = int(identity["partitions"])
    first = next(iter(have.values()))
    k, idx = int(first["windows"]), int(first["index"])
    name = f"{first['rollup']}-{idx}"
    held: dict[str, set[int]] = {}
    for p, s in have.items():
        for uid in s["parts"]:
            held.setdefault(uid, set()).add(p)
    entries = []
    quiet = noise_only_windows(have, ledger, P)
    for uid in sorted(held, key=lambda u: int(u.rsplit("/", 1)[1])):
        e = ledger.get(uid)
        w = uid.rsplit("/", 1)[1]
        if uid in quiet:
            # an event-time window no event fell in (the leader skipped it, nothing charged):
            # its views are noise alone, independent of the data; they stay in the sum as
            # layers and are not a base window of the release
            continue
        if e is None or e.get("kind") != "release":
            return (
                f"rollup {name} refused: base window {w} is not a ledgered release (a "
                "rollup only adds up released views); nothing of it is published",
                [],
                [],
            )
        if e.get("withheld"):
            return (
                f"rollup {name} withheld: base window {w} was withheld ({e['withheld']}) "
                "and its other partitions' slices are in the sums; nothing of it is "
                "published",
                [],
                [],
            )
        if len(held[uid]) != P:
            return (
                f"rollup {name} withheld: base window {w} is held by partitions "
                f"{sorted(held[uid])} of {P} only; nothing of it is published",
                [],
                [],
            )
        entries.append(e)
    have_windows = {int(u.rsplit("/", 1)[1]) for u in held}
    missing = []
    for w in range(idx * k, (idx + 1) * k):
        if w in have_windows:
            continue
        e = ledger.get(f"{identity['lineage']}/{w}")
        if w < int(identity["first_window"]) or e is None:
            why = "not counted by this group (before its first window)"
        else:
            why = "withheld by the ledger: it has no release"
        missing.append({"window": w, "why": why})
    return None, entries, missing


class RollupReleases:
    """The leader's part: collect rollup summaries, ask the ledger, release or withhold."""

    def __init__(self, leader, spans: dict[str, int]):
        self.leader, self.spans = leader, dict(spans)
        self.pending: dict[tuple[str, int], dict[int, dict]] = {}
        self._in_flight = None  # ((span, idx), entries, missing, future)
        #: decided by this leader: the ledger's copy in memory may lag its topic by a turn
        #: (the commit markers land after the commit returns), so never decide one twice
        self.done: set[tuple[str, int]] = set()

    def take(self, s: dict) -> bool:
        """A record of the summaries topic: True if it is a rollup summary (kept here)."""
        if s.get("rollup") is None:
            return False
        key = (s["rollup"], int(s["index"]))
        if key not in self.done:
            self.pending.setdefault(key, {})[int(s["partition"])] = s
        return True

    def _ready(self, have: dict, decided: set[int]) -> bool:
        lead = self.leader
        if len(have) < lead.P:
            return False
        s = next(iter(have.values()))
        last = (int(s["index"]) + 1) * int(s["windows"]) - 1
        held = {int(u.rsplit("/", 1)[1]) for x in have.values() for u in x["parts"]}
        if last >= int(lead.identity["first_window"]):
            held.add(last)
        # windows are decided in order: one below a decided window was decided or skipped
        top = max(decided, default=None)
        return all(w in decided or (top is not None and w < top) for w in held)

    def step(self, decided: set[int]) -> None:
        lead = self.leader
        if self._in_flight is not None:
            key, entries, missing, fut = self._in_flight
            if not fut.done():
                return
            self._in_flight = None
            self._publish(key, entries, missing, fut.result())
        for key in sorted(self.pending, key=lambda t: (t[1], t[0])):
            have = self.pending[key]
            if not self._ready(have, decided):
                continue
            rid = f"{lead.identity['lineage']}/rollup-{key[0]}-{key[1]}"
            if lead.ledger.has(rid):  # decided by an earlier leader
                self._transact(key, have, entry=None, document=None)
                continue
            if not any(s["parts"] for s in have.values()):
                log.info("rollup %s-%d holds no released base window: nothing to release", *key)
                self._transact(key, have, entry=None, document=None)
                continue
            reason, entries, missing = judge_rollup(have, lead.ledger, lead.identity)
            if not reason and not entries:
                log.info(
                    "rollup %s-%d holds only windows no event fell in: nothing to release", *key
                )
                self._transact(key, have, entry=None, document=None)
                continue
            if reason:
                log.warning("%s", reason)
                self._transact(
                    key,
                    have,
                    document=None,
                    entry=dict(
                        entry_id=rid,
                        kind="refused-rollup",
                        window=f"{key[0]}-{key[1]}",
                        epsilon_spent=0.0,
                        note=reason,
                        rollup=key[0],
                        lineage=lead.identity["lineage"],
                    ),
                )
                continue
            summaries = [have[p] for p in range(lead.P)]
            if lead.merge is None:
                self._publish(
                    key, entries, missing, merge_summaries(summaries, **lead.merge_kwargs)
                )
            else:  # beside the loop: a week of 1e6 counters takes a while
                self._in_flight = (
                    key,
                    entries,
                    missing,
                    lead.merge(summaries, **lead.merge_kwargs),
                )
                return

    def _publish(self, key, entries: list, missing: list, release: dict) -> None:
        lead = self.leader
        span, idx = key
        have = self.pending.get(key, {})
        r = RollupSum(span, idx, windows=self.spans[span], p=release["p"], mode="", size=0)
        quiet = noise_only_windows(have, lead.ledger, lead.P)
        for s in have.values():
            for uid, part in s["parts"].items():
                if uid not in quiet:
                    r.parts.setdefault(uid, part)
        extra = (
            {"noise_only_windows": sorted(int(u.rsplit("/", 1)[1]) for u in quiet)} if quiet else {}
        )  # in the sum as noise layers only (event-time windows, no event)
        publish_rollup(
            lead,
            r,
            entries,
            missing,
            release,
            scale_out={
                "store": "kafka",
                "partitions": lead.P,
                "members": sorted({s.get("member", "") for s in have.values()}),
            },
            tombstones=[(lead.topics.summaries, f"r/{span}/{idx}/{p}".encode()) for p in have],
            extra=extra,
        )
        self.done.add(key)
        self.pending.pop(key, None)

    def _transact(self, key, have: dict, *, entry: dict | None, document: str | None) -> None:
        """The ledger entry (if any), the document (if any) and the rollup summaries'
        tombstones in one transaction."""
        span, idx = key
        transact_rollup(
            self.leader,
            f"{span}-{idx}",
            entry=entry,
            document=document,
            tombstones=[
                (self.leader.topics.summaries, f"r/{span}/{idx}/{p}".encode()) for p in have
            ],
        )
        self.done.add(key)
        self.pending.pop(key, None)


def publish_rollup(
    lead,
    r: RollupSum,
    entries: list,
    missing: list,
    release: dict,
    *,
    scale_out: dict,
    tombstones: list,
    extra: dict | None = None,
) -> None:
    """Publish rollup ``r``'s ``release`` (computed from its sum) over the base windows' ledger
    ``entries``, naming the ``missing`` ones: the document, its ledger entry (0 eps) and the
    ``tombstones`` (topic, key) of what the sum was kept in, in one transaction; then the local
    file, metrics and one line. ``lead`` is the group's leader (items and views alike)."""
    name = f"{r.span}-{r.index}"
    info = release["window_info"]
    release["window_info"] = {
        k: info[k] for k in ("kind", "size", "events", "started_unix", "ended_unix")
    }
    release["window_info"]["base_kind"] = lead.window_kind
    release["rollup"] = rollup_block(r, missing, release["layers"])
    release["rollup"].update(extra or {})
    if missing:
        release["caveat"] = missing_caveat(name, len(r.parts), r.windows, missing)
        log.warning(
            "rollup %s holds %d of %d base windows (%d missing; the release says which and why)",
            name,
            len(r.parts),
            r.windows,
            len(missing),
        )
    if lead.aggregation:
        release["aggregation"] = {"name": lead.aggregation}
    if lead.rollup_level:
        release["rollup_level"] = dict(lead.rollup_level)
    rid = f"{lead.identity['lineage']}/rollup-{name}"
    release["window_uid"] = rid
    release["scale_out"] = scale_out
    stamp_window(release)
    doc = json.dumps(release, allow_nan=False, sort_keys=True)
    entry = dict(
        entry_id=rid,
        kind="rollup",
        window=name,
        epsilon_spent=0.0,
        note=ROLLUP_ARGUMENT,
        rollup=r.span,
        n=int(release["n"]),
        base_windows=[
            {"window": e["window"], "uid": e["window_uid"], "seq": e["seq"], "hash": e["hash"]}
            for e in entries
        ],
        missing=[m["window"] for m in missing],
        lineage=lead.identity["lineage"],
        document_sha256=hashlib.sha256(doc.encode()).hexdigest(),
    )
    transact_rollup(lead, name, entry=entry, document=doc, tombstones=tombstones)
    path = lead.local_file(release, f"rollup {name}")
    lead.metrics.rollup_released(r.span, release)
    lead.metrics.published(release)
    log.info(
        "rollup %s: %d base windows, %d noise layers, n=%s, released at 0 extra eps "
        "(estimated in %.1f s) -> %s",
        name,
        len(r.parts),
        release["layers"],
        release["n"],
        release.get("release_seconds", float("nan")),
        path or lead.topics.releases,
    )


def transact_rollup(
    lead, name: str, *, entry: dict | None, document: str | None, tombstones: list
) -> None:
    """The rollup ``name``'s ledger entry (if any), its document (if any) and the
    ``tombstones`` (topic, key) in one transaction of the leader's."""

    txn = lead.txn
    try:
        txn.begin()
        if entry is not None:
            lead.ledger.append(model=lead.identity["model"], producer=txn, **entry)
        if document is not None:
            txn.send(lead.topics.releases, partition=0, key=name.encode(), value=document.encode())
            if lead.release_topic:
                txn.send(
                    lead.release_topic, key=lead.release_key(name).encode(), value=document.encode()
                )
        for topic, key in tombstones:
            txn.send(topic, partition=0, key=key, value=None)
        txn.commit()
    except KafkaError as exc:
        log.warning("rollup %s not decided (%s); it is tried again", name, type(exc).__name__)
        if entry is not None:
            lead.ledger.aborted()
        txn.failed(exc)
        raise
    if entry is not None:
        lead.ledger.committed()
    if document is not None:
        lead.metrics.last_release.set(time.time())
