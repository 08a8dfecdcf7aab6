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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

__all__ = ["Coverage", "check_aggregation", "check_directory", "check_rollups", "read_ledger",
           "read_releases", "read_rollups"]

WINDOW_KINDS = ("release", "refused")


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


def check_aggregation(entries: list[dict], docs: dict[int, list[dict]],
                      ends: dict[str, int] | None = None,
                      topic_docs: dict[int, list[dict]] | None = None,
                      begins: dict[str, int] | None = None,
                      size_of: Callable[[str, int, int], int] | None = None) -> Coverage:
    """The invariant of the module docstring over one aggregation's ledger ``entries``, its
    release documents ``docs`` (``{window: [document, ...]}``, one per publication) and, if
    known, the source's end offsets ``ends``, the release topic's publications and where each
    partition's counting began (``begins``: the first window must start there). ``size_of(part,
    a, b)``: the events positions ``[a, b)`` of ``part`` hold (default ``b - a``: one record
    each; a group's repartition records hold several)."""
    cov = Coverage()
    bad = cov.violations.append
    decided = [e for e in entries if e.get("kind") in WINDOW_KINDS]
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
        if e["kind"] == "refused":
            cov.refused.append(w)
            continue
        cov.windows.append(w)
        # the entry's totals are running sums; a window's own rejects are the difference
        n = int(e["n"])
        cov.released_events += n
        other = _window_others(decided, e)
        if n + other != size:
            bad(f"window {w}: n {n} + {other} rejected/filtered but its ranges hold {size} "
                "records")
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
        if begins is not None and ss[0][0] != begins.get(part, 0):
            bad(f"{part}: offsets [{begins.get(part, 0)}, {ss[0][0]}) before window {ss[0][2]} "
                "are in no window")
        for (a0, b0, w0), (a1, b1, w1) in zip(ss, ss[1:]):
            if b0 < a1:
                bad(f"{part}: offsets [{b0}, {a1}) between windows {w0} and {w1} are in no "
                    "window")
            elif b0 > a1:
                bad(f"{part}: offsets [{a1}, {b0}) are in windows {w0} and {w1}")
        cov.covered[part] = max(b for _, b, _ in ss)
        if ends is not None and cov.covered[part] > ends.get(part, 0):
            bad(f"{part}: windows cover up to {cov.covered[part]}, past the source's end "
                f"{ends.get(part, 0)}")
    return cov


def read_rollups(release_dir: Path) -> list[dict]:
    """The sum rollups' release documents in ``release_dir`` (one per file)."""
    return [doc for doc in (json.loads(p.read_text())
                            for p in sorted(Path(release_dir).glob("release-*.json")))
            if "rollup" in doc]


def check_rollups(entries: list[dict], docs: dict[int, list[dict]],
                  rollup_docs: list[dict]) -> list[str]:
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
        elif entry.get("epsilon_spent") != 0.0 or entry.get("n") != d["n"] or \
                [b["window"] for b in entry.get("base_windows", [])] != r["windows"]:
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


def check_directory(state_dir: Path, release_dir: Path, ends: dict[str, int] | None = None,
                    topic_docs: dict[str, dict[int, list[dict]]] | None = None,
                    begins: dict[str, int] | None = None) -> dict[str, Coverage]:
    """:func:`check_aggregation` for every aggregation of a service's directories: one (a
    ``ledger.jsonl`` at the top) or several (one directory each, with a release directory of
    the same name). ``topic_docs``: ``{aggregation: {window: [document]}}`` read from a release
    topic. Returns ``{aggregation name or "": Coverage}``."""
    state_dir, release_dir = Path(state_dir), Path(release_dir)
    if (state_dir / "ledger.jsonl").exists():
        units = {"": (state_dir, release_dir)}
    else:
        units = {p.name: (p, release_dir / p.name) for p in sorted(state_dir.iterdir())
                 if (p / "ledger.jsonl").exists()}
    out = {}
    for name, (sdir, rdir) in units.items():
        entries = read_ledger(sdir / "ledger.jsonl")
        docs = read_releases(rdir) if rdir.exists() else {}
        out[name] = check_aggregation(entries, docs, ends, (topic_docs or {}).get(name), begins)
        rolls = read_rollups(rdir) if rdir.exists() else []
        out[name].violations += check_rollups(entries, docs, rolls)
        out[name].rollups = len(rolls)
    return out
