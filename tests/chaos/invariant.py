"""The one invariant of every mode: nothing lost, nothing doubled, nothing silently shortened.

It reads only what a user can read after a run: each aggregation's ledger (``ledger.jsonl``),
its release directory (``release-<window>.json``), every publication of a window on a release
topic if there is one, and the source's end offsets. For each aggregation:

1. **Windows.** Every ``release`` or ``refused`` ledger entry is one window; window numbers are
   unique and consecutive from the first to the last (none missing in between).
2. **Ranges tile the source.** Per partition, the windows' ``[start, end)`` ranges follow each
   other without a gap or an overlap, from the first offset counted to where the open window
   starts (``covered``); nothing past the source's end.
3. **n equals the positions.** A release's ``n`` plus its rejects and filtered records is the
   number of records in its ranges (the harness's producer writes one record per offset, no
   transaction markers).
4. **Published once, with one content.** Each release entry has its document in the release
   directory with the same window and n; every publication of a window (files and topic) has
   the same content; no document exists without its ledger entry.
5. **Nothing lost without a name.** A refused (withheld) window names its ranges in its entry,
   so every offset below ``covered`` is in exactly one named window.
6. **Deleted only where named, and really deleted.** Source records the topic's retention (or
   ``kafka-delete-records``) deleted before they were counted are accounted for only where a
   refused or withheld entry names them ("records of partition P from offset A to B were
   deleted by the retention of T before they were counted", the words of
   ``aggregator/service/group/deleted.py``): such a span may fill a gap between windows, no
   released window may hold it, and it must lie below the partition's first offset now (the
   topic's log start offset, which a user reads as any consumer does): a span named deleted
   whose records are still there is a loss dressed as a deletion. :func:`check_source_spans`
   applies the same rule where the ledger's ranges are not source positions (the items
   exchange: its repartition messages name the source positions they came from).

:func:`check_aggregation` returns the violations (strings; empty: the invariant holds) and
what was covered, so a harness can add what only it knows (every produced event released).

>>> entries = [
...     {"kind": "release", "window": 0, "n": 3, "ranges": {"t:0": [0, 3]},
...      "totals": {"events": 3, "rejects": {}}},
...     {"kind": "release", "window": 1, "n": 2, "ranges": {"t:0": [3, 5]},
...      "totals": {"events": 5, "rejects": {}}}]
>>> docs = {0: [{"window": 0, "n": 3}], 1: [{"window": 1, "n": 2}]}
>>> check_aggregation(entries, docs, ends={"t:0": 7}).violations
[]
>>> entries[1]["n"] = 1  # a window that lost an event
>>> check_aggregation(entries, docs, ends={"t:0": 7}).violations[0]
'window 1: n 1 + 0 rejected/filtered but its ranges hold 2 records'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = [
    "Coverage",
    "check_aggregation",
    "check_directory",
    "check_rollups",
    "check_source_spans",
    "named_deleted",
    "read_ledger",
    "read_releases",
    "read_rollups",
]

WINDOW_KINDS = ("release", "refused")

#: how a ledger entry names source records deleted before they were counted (the words of
#: aggregator.service.group.deleted.deleted_text; the topic is the source topic)
DELETED = re.compile(
    r"records of partition (\d+) from offset (\d+) to (\d+) were deleted by "
    r"the retention of (\S+) before they were counted"
)


@dataclass
class Coverage:
    """What one aggregation's ledger says was decided, and what is wrong with it."""

    violations: list[str] = field(default_factory=list)
    #: per partition, where the decided windows end (the open window starts there)
    covered: dict[str, int] = field(default_factory=dict)
    #: per partition, where the first decided window starts
    first: dict[str, int] = field(default_factory=dict)
    released_events: int = 0
    windows: list[int] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)
    #: sum rollups checked (:func:`check_rollups`)
    rollups: int = 0
    #: source positions refused or withheld entries name as deleted before they were counted
    deleted: int = 0


def read_ledger(path: Path) -> list[dict]:
    """The entries of ``ledger.jsonl`` (a torn last line, which a kill leaves, is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def read_releases(release_dir: Path) -> dict[int, list[dict]]:
    """``{window: [document]}`` of the window releases in ``release_dir`` (rollups left out)."""
    out: dict[int, list[dict]] = {}
    for path in sorted(Path(release_dir).glob("release-*.json")):
        doc = json.loads(path.read_text())
        if "rollup" in doc or not isinstance(doc.get("window"), int):
            continue
        out.setdefault(doc["window"], []).append(doc)
    return out


def _content(doc: dict) -> str:
    # what a consumer of the release reads; the publication's own time may differ
    keep = {k: v for k, v in doc.items() if k not in ("published_unix",)}
    return json.dumps(keep, sort_keys=True)


def check_aggregation(
    entries: list[dict],
    docs: dict[int, list[dict]],
    ends: dict[str, int] | None = None,
    topic_docs: dict[int, list[dict]] | None = None,
    begins: dict[str, int] | None = None,
    size_of: Callable[[str, int, int], int] | None = None,
    lows: dict[str, int] | None = None,
) -> Coverage:
    """The invariant of the module docstring over one aggregation's ledger ``entries``, its
    release documents ``docs`` (``{window: [document, ...]}``, one per publication) and, if
    known, the source's end offsets ``ends``, the release topic's publications and where each
    partition's counting began (``begins``: the first window must start there). ``size_of(part,
    a, b)``: the events positions ``[a, b)`` of ``part`` hold (default ``b - a``: one record
    each; a group's repartition records hold several). ``lows``: each source partition's first
    offset now; given, every span a refused entry names deleted must lie below it (rule 6).

    Rule 6, a silent loss and the same loss named (the source now begins at 9 on partition 0):

    >>> rel = lambda w, a, b: {"kind": "release", "window": w, "n": b - a,
    ...                        "ranges": {"t:0": [a, b]}, "totals": {"rejects": {}}}
    >>> docs = {0: [{"n": 3}], 2: [{"n": 3}]}
    >>> silent = [rel(0, 0, 3), {"kind": "refused", "window": 1, "ranges": {}}, rel(2, 9, 12)]
    >>> check_aggregation(silent, docs, ends={"t:0": 12}, lows={"t:0": 9}).violations
    ['t:0: offsets [3, 9) between windows 0 and 2 are in no window']
    >>> why = ("records of partition 0 from offset 3 to 9 were deleted by the retention of t "
    ...        "before they were counted")
    >>> named = [silent[0], dict(silent[1], note=why), silent[2]]
    >>> cov = check_aggregation(named, docs, ends={"t:0": 12}, lows={"t:0": 9})
    >>> cov.violations, cov.deleted
    ([], 6)
    >>> print(*check_aggregation(named, docs, ends={"t:0": 12}, lows={"t:0": 5}).violations)
    window 1 names t:0 offsets [3, 9) deleted, but the source still holds [5, 9) (it begins at 5)
    """
    cov = Coverage()
    bad = cov.violations.append
    decided = [e for e in entries if e.get("kind") in WINDOW_KINDS]
    named = named_deleted(decided)
    cov.deleted = sum(b - a for spans in named.values() for a, b, _ in _union(spans))
    ids = [e["window"] for e in decided]
    if len(ids) != len(set(ids)):
        dup = sorted({w for w in ids if ids.count(w) > 1})
        bad(f"windows decided twice in the ledger: {dup}")
    if ids:
        missing = sorted(set(range(min(ids), max(ids) + 1)) - set(ids))
        if missing:
            bad(f"windows missing between {min(ids)} and {max(ids)}: {missing}")
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for e in sorted(decided, key=lambda e: e["window"]):
        w = e["window"]
        ranges = e.get("ranges")
        if ranges is None:
            bad(f"window {w}: {e['kind']} entry names no ranges")
            continue
        size = 0
        for part, (a, b) in ranges.items():
            if b < a:
                bad(f"window {w}: range {part} [{a}, {b}) runs backwards")
            size += (b - a) if size_of is None else size_of(part, a, b)
            spans.setdefault(part, []).append((a, b, w))
            for x, y, u in named.get(part, []) if e["kind"] == "release" else ():
                if max(a, x) < min(b, y):
                    bad(
                        f"window {w}: released over {part} offsets [{max(a, x)}, {min(b, y)}), "
                        f"which window {u} names deleted before they were counted"
                    )
        if e["kind"] == "refused":
            cov.refused.append(w)
            continue
        cov.windows.append(w)
        # the entry's totals are running sums; a window's own rejects are the difference
        n = int(e["n"])
        cov.released_events += n
        other = _window_others(decided, e)
        if n + other != size:
            bad(f"window {w}: n {n} + {other} rejected/filtered but its ranges hold {size} records")
        published = docs.get(w, [])
        if not published:
            bad(f"window {w}: released in the ledger but no release document")
        for doc in published + list((topic_docs or {}).get(w, [])):
            if doc.get("n") != n:
                bad(f"window {w}: a published document says n={doc.get('n')}, the ledger {n}")
        contents = {_content(d) for d in published + list((topic_docs or {}).get(w, []))}
        if len(contents) > 1:
            bad(f"window {w}: published with {len(contents)} different contents")
    for w in sorted(set(docs) | set(topic_docs or {})):
        if w not in cov.windows:
            bad(f"window {w}: a document is published but the ledger has no release of it")
    for part, ss in sorted(spans.items()):
        ss.sort()
        cov.first[part] = ss[0][0]
        begin = None if begins is None else begins.get(part, 0)
        if begin is not None and ss[0][0] < begin:
            bad(f"{part}: window {ss[0][2]} starts at {ss[0][0]}, before the source's {begin}")
        for x, y in (
            _uncovered(begin or 0, ss[0][0], named.get(part, [])) if begin is not None else ()
        ):
            bad(f"{part}: offsets [{x}, {y}) before window {ss[0][2]} are in no window")
        for (a0, b0, w0), (a1, b1, w1) in zip(ss, ss[1:]):
            if b0 < a1:  # a gap: accounted for only where an entry names it deleted
                for x, y in _uncovered(b0, a1, named.get(part, [])):
                    bad(
                        f"{part}: offsets [{x}, {y}) between windows {w0} and {w1} are in no window"
                    )
            elif b0 > a1:
                bad(f"{part}: offsets [{a1}, {b0}) are in windows {w0} and {w1}")
        cov.covered[part] = max(b for _, b, _ in ss)
        if ends is not None and cov.covered[part] > ends.get(part, 0):
            bad(
                f"{part}: windows cover up to {cov.covered[part]}, past the source's end "
                f"{ends.get(part, 0)}"
            )
    if lows is not None:
        cov.violations += _named_still_there(named, lows)
    return cov


def named_deleted(entries: list[dict]) -> dict[str, list[tuple[int, int, int]]]:
    """Per source partition (``topic:p``), the spans ``[a, b)`` that refused or withheld
    entries (their ``note`` or ``withheld`` reason) name as deleted before they were counted,
    each with the first window naming it; a span named by several windows is one span.

    >>> why = ("records of partition 2 from offset 5 to 9 were deleted by the retention of "
    ...        "src before they were counted; window range [5, 9) cannot be released whole")
    >>> named_deleted([{"kind": "release", "window": 3, "withheld": why},
    ...                {"kind": "refused", "window": 4, "note": why},
    ...                {"kind": "release", "window": 5, "n": 1, "note": why}])
    {'src:2': [(5, 9, 3)]}
    """
    out: dict[str, list[tuple[int, int, int]]] = {}
    for e in sorted(
        (e for e in entries if e.get("kind") in WINDOW_KINDS), key=lambda e: e["window"]
    ):
        if e["kind"] == "release" and not e.get("withheld"):
            continue  # a released window names nothing deleted
        for m in DELETED.finditer(str(e.get("withheld") or e.get("note") or "")):
            mine = out.setdefault(f"{m.group(4)}:{m.group(1)}", [])
            span = (int(m.group(2)), int(m.group(3)))
            if all((a, b) != span for a, b, _ in mine):
                mine.append((*span, e["window"]))
    return {k: sorted(v) for k, v in sorted(out.items())}


def check_source_spans(
    counted: dict[str, list[tuple[int, int]]],
    named: dict[str, list[tuple[int, int, int]]],
    ends: dict[str, int],
    lows: dict[str, int],
) -> list[str]:
    """Rule 6 where the ledger's ranges are not source positions (the items exchange): per
    source partition, the spans of source positions the counted messages came from
    (``counted``; one span repeated, a poll's on every repartition partition, is one) and the
    spans entries name deleted (:func:`named_deleted`) hold every offset from 0 to the end
    exactly once, and every named span lies below the partition's first offset now.

    >>> counted = {"s:0": [(0, 4), (9, 12), (9, 12)]}
    >>> check_source_spans(counted, {}, {"s:0": 12}, {"s:0": 9})
    ['s:0: offsets [4, 9) were neither counted nor named deleted']
    >>> check_source_spans(counted, {"s:0": [(4, 9, 1)]}, {"s:0": 12}, {"s:0": 9})
    []
    >>> check_source_spans(counted, {"s:0": [(2, 9, 1)]}, {"s:0": 12}, {"s:0": 9})
    ['s:0: offsets [2, 4) were counted and named deleted (window 1)']
    """
    out = []
    for key in sorted(set(ends) | set(counted) | set(named)):
        spans = sorted(
            [(a, b, "") for a, b in set(counted.get(key, ()))]
            + [(a, b, f"window {w}") for a, b, w in _union(named.get(key, []))]
        )
        at = 0
        for a, b, who in spans:
            if a > at:
                out.append(f"{key}: offsets [{at}, {a}) were neither counted nor named deleted")
            elif a < at:
                twice = f"[{a}, {min(at, b)})"
                out.append(
                    f"{key}: offsets {twice} were counted and named deleted ({who})"
                    if who
                    else f"{key}: offsets {twice} were counted twice"
                )
            at = max(at, b)
        end = ends.get(key, 0)
        if at < end:
            out.append(f"{key}: offsets [{at}, {end}) were neither counted nor named deleted")
        elif at > end:
            out.append(f"{key}: counted up to {at}, past the source's end {end}")
    return out + _named_still_there(named, lows)


def _named_still_there(
    named: dict[str, list[tuple[int, int, int]]], lows: dict[str, int]
) -> list[str]:
    """A span named deleted must be gone: below the partition's first offset now."""
    out = []
    for key, spans in sorted(named.items()):
        for a, b, w in spans:
            low = lows.get(key)
            if low is None:
                out.append(
                    f"window {w} names records of {key} deleted, a partition the source "
                    "does not have"
                )
            elif b > low:
                out.append(
                    f"window {w} names {key} offsets [{a}, {b}) deleted, but the source "
                    f"still holds [{max(a, low)}, {b}) (it begins at {low})"
                )
    return out


def _union(spans: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``spans`` (a, b, window) merged where they overlap (the first window kept)."""
    out: list[tuple[int, int, int]] = []
    for a, b, w in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b), out[-1][2])
        else:
            out.append((a, b, w))
    return out


def _uncovered(a: int, b: int, spans: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The parts of ``[a, b)`` no span of ``spans`` (a, b, window) covers."""
    out, at = [], a
    for x, y, _ in _union(spans):
        if y <= at or x >= b:
            continue
        if x > at:
            out.append((at, x))
        at = max(at, y)
    if at < b:
        out.append((at, b))
    return out


def read_rollups(release_dir: Path) -> list[dict]:
    """The sum rollups' release documents in ``release_dir`` (one per file)."""
    return [
        doc
        for doc in (
            json.loads(p.read_text()) for p in sorted(Path(release_dir).glob("release-*.json"))
        )
        if "rollup" in doc
    ]


def check_rollups(
    entries: list[dict], docs: dict[int, list[dict]], rollup_docs: list[dict]
) -> list[str]:
    """Sum rollups (``rollup_design = sum``) over the released windows ``docs``: each rollup is
    ledgered once (kind ``rollup``, 0 eps) and published with one content, its n is the sum of
    the n of the base windows it names, which are released windows of its span, each in one
    rollup of the span, and none it could hold is left out but those its document names as
    missing.

    >>> base = {4: [{"window": 4, "n": 3}], 5: [{"window": 5, "n": 2}]}
    >>> roll = {"window": "2x-2", "n": 5, "rollup": {"span": "2x", "index": 2,
    ...         "base_windows": 2, "windows": [4, 5], "missing": []}}
    >>> led = [{"kind": "rollup", "window": "2x-2", "n": 5, "epsilon_spent": 0.0,
    ...         "base_windows": [{"window": 4}, {"window": 5}]}]
    >>> check_rollups(led, base, [roll])
    []
    >>> for v in check_rollups(led, base, [dict(roll, n=3)]):   # an event lost from it
    ...     print(v)
    rollup 2x-2: its ledger entry disagrees with its document
    rollup 2x-2: n 3, its base windows [4, 5] hold 5
    >>> twice = dict(roll, window="2x-3", rollup=dict(roll["rollup"], index=3))
    >>> for v in check_rollups(led, base, [roll, twice])[-2:]:   # windows 4, 5 summed twice
    ...     print(v)
    rollup 2x-3: base window 5 is not a released window of it
    base window 5 is in rollups 2x-2 and 2x-3
    """
    out = []
    bad = out.append
    led = [e for e in entries if e.get("kind") == "rollup"]
    names = [e["window"] for e in led]
    if len(names) != len(set(names)):
        bad(f"rollups ledgered twice: {sorted({n for n in names if names.count(n) > 1})}")
    by_name: dict[str, list[dict]] = {}
    for d in rollup_docs:
        by_name.setdefault(str(d["window"]), []).append(d)
    seen: dict[str, dict[int, str]] = {}
    for name, published in sorted(by_name.items()):
        if len({_content(d) for d in published}) > 1:
            bad(f"rollup {name}: published with several contents")
        d = published[0]
        r = d["rollup"]
        entry = next((e for e in led if e["window"] == name), None)
        if entry is None:
            bad(f"rollup {name}: published but not in the ledger")
        elif (
            entry.get("epsilon_spent") != 0.0
            or entry.get("n") != d["n"]
            or [b["window"] for b in entry.get("base_windows", [])] != r["windows"]
        ):
            bad(f"rollup {name}: its ledger entry disagrees with its document")
        k, idx = int(r["base_windows"]), int(r["index"])
        held = sum(int(docs[w][0]["n"]) for w in r["windows"] if w in docs)
        if held != d["n"]:
            bad(f"rollup {name}: n {d['n']}, its base windows {r['windows']} hold {held}")
        for w in r["windows"]:
            if w not in docs or not idx * k <= w < (idx + 1) * k:
                bad(f"rollup {name}: base window {w} is not a released window of it")
            other = seen.setdefault(r["span"], {}).setdefault(w, name)
            if other != name:
                bad(f"base window {w} is in rollups {other} and {name}")
        named = set(r["windows"]) | {m["window"] for m in r.get("missing", [])}
        left = [w for w in range(idx * k, (idx + 1) * k) if w in docs and w not in named]
        if left:
            bad(f"rollup {name}: released base windows {left} are left out unnamed")
    for name in names:
        if name not in by_name:
            bad(f"rollup {name}: ledgered but never published")
    return out


def _window_others(decided: list[dict], entry: dict) -> int:
    """The rejected and filtered records of ``entry``'s window: its totals minus those of the
    window before it (the totals are running sums of the lineage)."""

    def others(e):
        t = e.get("totals") or {}
        return sum((t.get("rejects") or {}).values()) + int(t.get("filtered", 0))

    before = [e for e in decided if e["window"] == entry["window"] - 1 and e.get("totals")]
    mine = others(entry)
    return mine - others(before[0]) if before else mine


def check_directory(
    state_dir: Path,
    release_dir: Path,
    ends: dict[str, int] | None = None,
    topic_docs: dict[str, dict[int, list[dict]]] | None = None,
    begins: dict[str, int] | None = None,
    lows: dict[str, int] | None = None,
) -> dict[str, Coverage]:
    """:func:`check_aggregation` for every aggregation of a service's directories: one (a
    ``ledger.jsonl`` at the top) or several (one directory each, with a release directory of
    the same name). ``topic_docs``: ``{aggregation: {window: [document]}}`` read from a release
    topic; ``lows``: the source's first offsets now (rule 6). Returns ``{aggregation name or
    "": Coverage}``."""
    state_dir, release_dir = Path(state_dir), Path(release_dir)
    if (state_dir / "ledger.jsonl").exists():
        units = {"": (state_dir, release_dir)}
    else:
        units = {
            p.name: (p, release_dir / p.name)
            for p in sorted(state_dir.iterdir())
            if (p / "ledger.jsonl").exists()
        }
    out = {}
    for name, (sdir, rdir) in units.items():
        entries = read_ledger(sdir / "ledger.jsonl")
        docs = read_releases(rdir) if rdir.exists() else {}
        out[name] = check_aggregation(
            entries, docs, ends, (topic_docs or {}).get(name), begins, lows=lows
        )
        rolls = read_rollups(rdir) if rdir.exists() else []
        out[name].violations += check_rollups(entries, docs, rolls)
        out[name].rollups = len(rolls)
    return out
