"""``panagg status --group G --bootstrap B``: a Kafka-only scale-out group, read from Kafka.

Nothing of it is on any member's disk, so the status comes from the broker: the counting group's
members and the partitions each holds (the group coordinator), each partition's next window and
its backlog (committed offsets with their metadata against the end offsets), the intake's
backlog on the source topic, the windows whose summaries are still incomplete, and the ledger's
last release and epsilon spent. Every figure is metadata Kafka already shows to any client that
may describe the group (offsets and counts of messages), never counters.
"""

from __future__ import annotations

import hashlib
import json
import time
from types import SimpleNamespace

from kafka import KafkaConsumer, TopicPartition
from kafka.admin import KafkaAdminClient

from consumers.kafka_security import client_options

from ..status import release_history
from .count_windows import cut_key
from .forced import DONE, EXPORT, EXPORTED, REQUEST
from .ledger_topic import TopicLedger
from .topics import GroupTopics, read_partition

__all__ = [
    "collect_group_status",
    "format_group_status",
    "group_aggregations",
    "group_release_history",
]


def group_aggregations(topic_names, group: str) -> list[str]:
    """The aggregations of ``group`` whose ledger topic is among ``topic_names`` ("" for a
    group of one).

    >>> group_aggregations(["g.panagg.ledger", "g.panagg.ip.ledger", "h.panagg.ledger"], "g")
    ['', 'ip']
    """
    head, tail = f"{group}.panagg.", ".ledger"
    out = []
    for t in topic_names:
        if t == f"{group}.panagg.ledger":
            out.append("")
        elif t.startswith(head) and t.endswith(tail) and "." not in t[len(head) : -len(tail)]:
            out.append(t[len(head) : -len(tail)])
    return sorted(out)


def collect_group_status(
    bootstrap: str,
    group: str,
    security: dict | None = None,
    source_topic: str = "",
    aggregation: str = "",
) -> dict:
    topics = GroupTopics(group, aggregation)
    opts = dict(bootstrap_servers=bootstrap, **client_options(security))
    admin = KafkaAdminClient(**opts)
    out: dict = {"group": group, "aggregation": aggregation}
    try:
        if topics.ledger not in set(admin.list_topics()):
            raise LookupError(
                f"no Kafka-only group {group!r} on {bootstrap} (its topic "
                f"{topics.ledger} does not exist); check --group (source.group)"
            )
        described = admin.describe_groups([topics.counting_group]).get(topics.counting_group, {})
        committed = admin.list_group_offsets(topics.counting_group).get(topics.counting_group, {})
        consumer = KafkaConsumer(
            **opts, group_id=None, isolation_level="read_committed", enable_auto_commit=False
        )
        try:
            ledger = TopicLedger(consumer, topics.ledger, budget_per_window=1.0)
            ledger.read_to_end()
            ident = ledger.identity() or {}
            # the partitions the members count: the repartition topic's, or (scale.exchange =
            # views) the source topic's, which the counting group then commits
            counted = topics.repartition
            if ident.get("exchange") == "views":
                counted = next(
                    (tp.topic for tp in committed if tp.topic != topics.ledger),
                    source_topic or counted,
                )
            members = []
            for m in described.get("members") or []:
                parts = _assigned(m)
                members.append(
                    {
                        "member": m.get("group_instance_id") or m.get("client_id"),
                        "host": str(m.get("client_host", "")).lstrip("/"),
                        "partitions": sorted(p for t, p in parts if t == counted),
                        "leads": any(t == topics.ledger for t, _ in parts),
                    }
                )
            out["members"] = sorted(members, key=lambda m: m["member"])
            out["state"] = described.get("group_state", "")
            out["exchange"] = ident.get("exchange", "items")
            parts = sorted(consumer.partitions_for_topic(counted) or [])
            tps = [TopicPartition(counted, p) for p in parts]
            ends = consumer.end_offsets(tps)
            rows = []
            for tp in tps:
                c = committed.get(tp)
                meta = json.loads(c.metadata) if c is not None and c.metadata else {}
                rows.append(
                    {
                        "partition": tp.partition,
                        # (event-time views: the window after the last one closed there)
                        "next_window": meta.get("w", meta["k"] + 1 if "k" in meta else None),
                        "committed": None if c is None else c.offset,
                        "backlog_messages": ends[tp] - (c.offset if c is not None else 0),
                    }
                )
            out["partitions"] = rows
            if source_topic and out["exchange"] != "views":
                intake = admin.list_group_offsets(group).get(group, {})
                src = [
                    TopicPartition(source_topic, p)
                    for p in sorted(consumer.partitions_for_topic(source_topic) or [])
                ]
                src_end = consumer.end_offsets(src)
                out["intake_backlog_records"] = sum(
                    src_end[tp] - (intake[tp].offset if tp in intake else 0) for tp in src
                )
            rel = [e for e in ledger.entries if e["kind"] == "release"]
            out["identity"] = {
                k: ident.get(k)
                for k in (
                    "mode",
                    "size",
                    "epsilon",
                    "partitions",
                    "window_size",
                    "first_window",
                    "window_kind",
                    "allowed_lateness_s",
                )
            }
            out["releases"] = len([e for e in rel if not e.get("withheld")])
            out["withheld"] = len([e for e in rel if e.get("withheld")])
            out["epsilon_spent"] = ledger.spent()
            if rel:
                last = rel[-1]
                out["last_release"] = {
                    "window": last["window"],
                    "n": last.get("n"),
                    "time_unix": last["time_unix"],
                }
            decided = {e["window"] for e in rel}
            out["windows_waiting"] = _waiting(consumer, topics, decided)
            out.update(_intake_state(consumer, topics))
            reports = _reports(consumer, topics)
            now = time.time()
            for m in out["members"]:
                r = reports.pop(m["member"], None)
                if r is not None:
                    m.update(
                        seen_s_ago=round(now - r["time_unix"], 1),
                        ready=r.get("ready"),
                        reason=r.get("reason", ""),
                        metrics_url=r.get("metrics_url", ""),
                        intake_lag_records=r.get("intake_lag_records"),
                    )
            out["gone"] = [
                {"member": k, "seen_s_ago": round(now - r["time_unix"], 1)}
                for k, r in sorted(reports.items())
            ]
        finally:
            consumer.close()
    finally:
        admin.close()
    return out


def group_release_history(
    bootstrap: str,
    group: str,
    security: dict | None = None,
    aggregation: str = "",
    level: float | None = None,
) -> list[dict]:
    """``panagg history`` of a Kafka-only group: the rows of
    :func:`aggregator.service.status.release_history` from the group's ledger topic, each
    release's document read from the group's releases topic (the leader writes both in one
    transaction; the ledger entry holds the document's sha256, which is checked here).
    LookupError (one line) when the group has no ledger topic on ``bootstrap``."""

    topics = GroupTopics(group, aggregation)
    opts = dict(bootstrap_servers=bootstrap, **client_options(security))
    admin = KafkaAdminClient(**opts)
    try:
        names = set(admin.list_topics())
    finally:
        admin.close()
    if topics.ledger not in names:
        raise LookupError(
            f"no Kafka-only group {group!r} on {bootstrap} (its topic "
            f"{topics.ledger} does not exist); check --group (source.group)"
        )
    consumer = KafkaConsumer(
        **opts, group_id=None, isolation_level="read_committed", enable_auto_commit=False
    )
    docs: dict[str, bytes] = {}
    try:
        ledger = TopicLedger(consumer, topics.ledger, budget_per_window=1.0)
        ledger.read_to_end()
        if topics.releases in names:
            tp = TopicPartition(topics.releases, 0)
            consumer.assign([tp])
            consumer.seek_to_beginning(tp)

            def keep(record) -> None:
                if record.key is not None and record.value is not None:
                    docs[record.key.decode()] = record.value

            if not read_partition(consumer, tp, keep):
                raise LookupError(
                    f"releases topic {topics.releases}: could not read to its end "
                    "within 30 s; check the broker"
                )
    finally:
        consumer.close()
    entries = []
    for e in ledger.entries:
        if e["kind"] not in ("release", "rollup") or e.get("withheld"):
            continue
        raw = docs.get(str(e["window"]))
        if raw is None or (
            e.get("document_sha256") and hashlib.sha256(raw).hexdigest() != e["document_sha256"]
        ):
            continue  # (compacted away, or not this entry's document: never shown as it)
        entries.append(dict(e, document=raw.decode()))
    kw = {} if level is None else {"level": level}
    return release_history(SimpleNamespace(entries=entries), **kw)  # type: ignore[arg-type]


def _assigned(member: dict) -> list[tuple[str, int]]:
    """(topic, partition) pairs of a described member's assignment (kafka-python 3's dicts)."""
    pairs = []
    for a in (member.get("member_assignment") or {}).get("assigned_partitions") or []:
        pairs.extend((a["topic"], int(p)) for p in a["partitions"])
    return pairs


def _waiting(consumer, topics, decided) -> dict[int, list[int]]:
    """{window: partitions with a summary} for the undecided windows in the summaries topic."""

    tp = TopicPartition(topics.summaries, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    #: window -> summary key -> the partitions it covers (a views group's view covers all of
    #: its member's partitions; its chunk messages, keys ``w/p/cK``, cover none)
    have: dict[int, dict[str, list[int]]] = {}

    def take(r):
        key = r.key.decode()
        parts = key.split("/")
        if len(parts) != 2:
            return
        w, p = int(parts[0]), int(parts[1])
        if r.value is None:
            have.get(w, {}).pop(key, None)
        else:
            covers = json.loads(r.value).get("covers") or [p]
            have.setdefault(w, {})[key] = [int(c) for c in covers]

    read_partition(consumer, tp, take, timeout_s=10)
    return {
        w: sorted({p for ps in keys.values() for p in ps})
        for w, keys in sorted(have.items())
        if keys and w not in decided
    }


def _intake_state(consumer, topics) -> dict:
    """From the intake topic: forced releases and exports asked and not yet answered, and (count
    windows) the events taken since the leader's last cut."""

    tp = TopicPartition(topics.intake, 0)
    if topics.intake not in (consumer.topics() or set()):
        return {}
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    rp = topics.repartition
    ids = {f"{k}{rp}": None for k in (REQUEST, DONE, EXPORT, EXPORTED)}
    totals: dict[str, int] = {}
    cut = None
    #: a views group's count windows: each source partition's latest progress report
    progress: dict[str, dict] = {}

    def take(r):
        nonlocal cut
        key = r.key.decode() if r.key else ""
        if r.value is None:
            return
        if key in ids:
            ids[key] = json.loads(r.value).get("id")
        elif key == cut_key(rp):
            cut = json.loads(r.value)
        elif key.startswith(f"n:{rp}:"):
            totals[key] = max(totals.get(key, 0), int(r.value))
        elif key.startswith("progress:"):
            progress[key] = json.loads(r.value)

    read_partition(consumer, tp, take, timeout_s=10)
    out: dict = {
        "requests_pending": [
            kind
            for kind, ask, done in (
                ("forced release", REQUEST, DONE),
                ("audit export", EXPORT, EXPORTED),
            )
            if ids[f"{ask}{rp}"] and ids[f"{ask}{rp}"] != ids[f"{done}{rp}"]
        ]
    }
    if progress:  # count windows of a views group (count_views.py)
        reports = list(progress.values())
        total = sum(int(r["t"]) for r in reports)
        goals = [int(r["g"]) for r in reports if r.get("g") is not None]
        out["count_open"] = {
            "window": min(int(r["w"]) for r in reports),
            "taken": total,
            "of_group": True,
            "to_cut": max(min(goals) - total, 0) if goals else None,
        }
    elif totals:
        cut = cut or {}
        total = sum(totals.values())
        out["count_open"] = {
            "window": cut.get("closed", -1) + 1,
            "taken": total - cut.get("total", 0),
            "to_cut": max(cut["next"] - total, 0) if "next" in cut else None,
        }
    return out


def _reports(consumer, topics) -> dict[str, dict]:
    """The latest report of every member that ever wrote one (``<group>.panagg.members``)."""

    tp = TopicPartition(topics.members, 0)
    if topics.members not in (consumer.topics() or set()):
        return {}
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    out: dict[str, dict] = {}

    def take(r):
        if r.value is not None:
            out[r.key.decode()] = json.loads(r.value)

    read_partition(consumer, tp, take, timeout_s=10)
    return out


def format_group_status(s: dict) -> list[str]:
    ident = s.get("identity", {})
    name = f"aggregation {s['aggregation']} of " if s.get("aggregation") else ""
    if ident.get("mode") is None:
        # the group's topics exist but no member has written the identity yet: the members
        # are starting (status run just after them, as the README's group loop does)
        lines = [
            f"{name}group {s['group']} (Kafka-only store): starting, no member has "
            "written the group's identity yet (mode, counters, eps, windows)"
        ]
    else:
        lines = [_identity_line(name, s["group"], ident)]
    return lines + _member_lines(s, ident)


def _identity_line(name: str, group: str, ident: dict) -> str:
    return (
        f"{name}group {group} (Kafka-only store): {ident.get('mode')} mode, "
        f"{ident.get('size')} counters in {ident.get('partitions')} slices, eps "
        f"{ident.get('epsilon')}, "
        + (
            f"event-time windows of {ident.get('window_size')} s (allowed lateness "
            f"{ident.get('allowed_lateness_s')} s)"
            if ident.get("window_kind") == "event_time"
            else f"count windows of {int(ident.get('window_size') or 0):,} events"
            if ident.get("window_kind") == "count"
            else f"windows of {ident.get('window_size')} s"
        )
    )


def _member_lines(s: dict, ident: dict) -> list[str]:
    lines = [f"members ({len(s['members'])}, group {s.get('state', '')}):"]
    for m in s["members"]:
        lead = ", leads (ledger, merges)" if m["leads"] else ""
        health = ""
        if "seen_s_ago" in m:
            health = (
                f"; {'ready' if m['ready'] else 'NOT READY: ' + m['reason']}, reported "
                f"{m['seen_s_ago']:.0f} s ago"
            )
            if m.get("intake_lag_records") is not None:
                health += f", intake lag {m['intake_lag_records']} record(s)"
            if m.get("metrics_url"):
                health += f", {m['metrics_url']}"
        lines.append(
            f"  {m['member']} on {m['host']}: partitions "
            f"{', '.join(map(str, m['partitions'])) or 'none'}{lead}{health}"
        )
    for g in s.get("gone") or []:
        if g["seen_s_ago"] < 24 * 3600:
            lines.append(
                f"  {g['member']}: not in the group, last report {g['seen_s_ago']:.0f} s ago"
            )
    held = {p for m in s["members"] for p in m["partitions"]}
    for row in s.get("partitions", []):
        owner = "" if row["partition"] in held else "  NOT HELD by any member"
        lines.append(
            f"  partition {row['partition']}: next window {row['next_window']}, "
            f"{row['backlog_messages']} message(s) behind (commit markers included){owner}"
        )
    if "intake_backlog_records" in s:
        lines.append(f"intake: {s['intake_backlog_records']} source record(s) not yet taken")
    waiting = s.get("windows_waiting") or {}
    if waiting:
        P = ident.get("partitions") or 0
        complete = [w for w, have in waiting.items() if len(have) == P]
        if complete:
            lines.append(
                f"{len(complete)} window(s) complete, being merged by the leader "
                f"({complete[0]}..{complete[-1]})"
            )
        short = [(w, have) for w, have in waiting.items() if len(have) < P]
        for w, have in short[:5]:
            missing = sorted(set(range(P)) - set(have))
            lines.append(f"window {w} waits for partition(s) {', '.join(map(str, missing))}")
        if len(short) > 5:
            lines.append(f"... and {len(short) - 5} more window(s) waiting")
    if s.get("count_open"):
        c = s["count_open"]
        size = int(ident.get("window_size") or 0)
        to_cut = c["to_cut"] if c["to_cut"] is not None else max(size - c["taken"], 0)
        if c.get("of_group"):
            lines.append(
                f"count window {c['window']} open: the group has counted "
                f"{c['taken']:,} events (members' reports), cut after {to_cut:,} "
                f"more (windows of {size:,})"
            )
        else:
            lines.append(
                f"count window {c['window']} open: {c['taken']:,} events taken "
                f"(committed by the intake), cut after {to_cut:,} more (windows of "
                f"{size:,})"
            )
    for kind in s.get("requests_pending") or []:
        lines.append(f"a {kind} is asked and not yet answered by the leader")
    last = s.get("last_release")
    lines.append(
        f"releases: {s.get('releases', 0)} ({s.get('withheld', 0)} withheld), "
        f"eps spent {s.get('epsilon_spent', 0):g}"
        + (
            f"; last: window {last['window']}, n={last['n']}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(last['time_unix']))} UTC"
            if last
            else ""
        )
    )
    return lines
