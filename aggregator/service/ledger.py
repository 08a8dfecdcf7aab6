"""The privacy ledger: the append-only, hash-chained authority on what was released and what it
cost.

Each line of ``ledger.jsonl`` is one JSON entry, written with fsync before the thing it records
becomes visible. Kinds:

``identity``
    What the state directory counts and under which settings (stream, mode, domain, epsilon,
    window, budget). Written once at the first start; a later start with other settings is
    refused unless the change is accepted explicitly, which appends a new ``identity`` entry
    carrying the previous one (so a lifted budget is on record).
``release``
    One window's release: its number, its random ``window_uid``, the epsilon spent, the release
    document itself, the **source position ranges** it covers (``ranges``: per partition
    ``[start, end)``, with the stream, the aggregation and the lineage of checkpoints it belongs
    to) and the totals at its end. A window already ledgered is re-published from this document
    and never replayed: a restart starts the next window at the ledgered end.
``refused``
    A release the budget did not allow (nothing was computed, no noise was drawn for it); it
    records its ranges at epsilon 0.
``export``, ``restart``, ``fresh-start``, ``composition``
    Announced audit exports (epsilon 0: fresh layers before and after), restarts that replayed
    part of a window (docs/privacy.md, R3), starts without a checkpoint that were explicitly
    allowed, and the set of aggregations an aggregation is part of.

One event, one charge. Before any release noise is drawn the window's ranges are checked against
every charged range of the stream (this ledger's and, with several aggregations, every other
aggregation's: :class:`~aggregator.service.charges.ChargeBook`): no position may carry more than
``budget_per_event``. ``budget_per_window`` caps the epsilon spent per window uid, and
``budget_total`` (optional) the sum over all entries: a proxy for a person who shows up in many
windows, since event-level epsilon is parallel across windows. A window with no events (n = 0,
public under replace-one) is released at epsilon 0.

Tamper evidence. Every entry carries its sequence number ``seq``, the hash of the previous entry
``prev`` and its own ``hash`` (SHA-256 over the entry's canonical JSON without ``hash``), so an
edited, dropped or re-ordered line breaks the chain. The head (``seq``, ``hash``) is anchored
where a restored or edited state directory does not reach it (the checkpoint, the release
directory and the Kafka group's committed offset metadata: :mod:`.anchor`); a ledger that does
not contain an anchor's entry (deleted, truncated, rolled back, replaced) is refused.

A damaged ledger (a line that is not a JSON entry, an entry without its fields, a broken chain)
stops the service with one line naming the line number: silently skipping a line would
under-count the budget. The only tolerated defect is a torn last line without a newline, which
a crash in the middle of an append leaves, and only while no anchor proves that line complete.
Ledgers of format 1 (no chain, no ranges) are refused with one line naming
``panagg ledger migrate``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

from state_store.atomic import atomic_write
from state_store.failpoints import failpoint

from .charges import ChargeBook

__all__ = [
    "Ledger",
    "BudgetExceeded",
    "LedgerError",
    "GENESIS",
    "entry_hash",
    "migrate",
    "sibling_ledger_paths",
]

log = logging.getLogger("panagg.ledger")

_REQUIRED = {"id": str, "kind": str, "epsilon_spent": (int, float), "time_unix": (int, float)}
_CHAINED = {"seq": int, "prev": str, "hash": str}

#: the ``prev`` of the first entry
GENESIS = "0" * 64


def entry_hash(entry: dict) -> str:
    """SHA-256 over the entry's canonical JSON without its ``hash`` field."""
    body = {k: v for k, v in entry.items() if k != "hash"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class BudgetExceeded(RuntimeError):
    """The release would spend more epsilon than the configured budget."""


class LedgerError(RuntimeError):
    """The ledger file cannot be trusted (a damaged line, a broken chain, an anchor it lacks)."""


class Ledger:
    """The ledger file at ``path`` with its budget rules (see the module docstring).

    Parameters
    ----------
    budget_per_window
        Epsilon one window uid may spend.
    budget_total
        Optional cap on the sum over every entry (None or 0: no cap).
    budget_per_event
        Cap on the charge of one source position over every release that covers it (default:
        ``budget_per_window``).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        budget_per_window: float,
        budget_total: float | None = None,
        budget_per_event: float | None = None,
    ):
        self.path = Path(path)
        self.budget_per_window = float(budget_per_window)
        self.budget_total = None if not budget_total else float(budget_total)
        self.budget_per_event = float(budget_per_event or budget_per_window)
        self.torn_tail = False
        self.reload()

    def reload(self) -> None:
        """Re-read the file (scale-out: several processes append to one shared ledger, each
        under the merge lock)."""
        self.entries: list[dict] = []
        #: called with each entry once it is durable (the budget registry records charges)
        self.listeners: list = []
        self._by_id: dict[str, dict] = {}
        self.torn_tail = False
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        torn_tail = not data.endswith(b"\n")
        prev = GENESIS
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            last = number == len(lines)
            try:
                entry = json.loads(raw)
                problem = self._problem(entry)
            except (json.JSONDecodeError, UnicodeDecodeError):
                entry, problem = None, "is not a JSON entry"
            if problem is None:
                problem = self._chain_problem(entry, len(self.entries) + 1, prev)
            if problem:
                if last and torn_tail:  # a crash mid-append; the operation is redone
                    log.warning(
                        "%s: ignoring the torn last line %d (an interrupted append)",
                        self.path,
                        number,
                    )
                    self.torn_tail = True
                    continue
                raise LedgerError(
                    f"ledger {self.path} line {number} {problem}; the ledger is the "
                    "record of privacy spent: restore the file from a backup "
                    "(never delete or edit its lines)"
                )
            self.entries.append(entry)
            self._by_id[entry["id"]] = entry
            prev = entry["hash"]

    @staticmethod
    def _problem(entry) -> str | None:
        if not isinstance(entry, dict):
            return "is not a JSON object"
        for field, kind in _REQUIRED.items():
            if field not in entry:
                return f"has no {field!r}"
            if not isinstance(entry[field], kind) or isinstance(entry[field], bool):
                return f"has a malformed {field!r}"
        return None

    def _chain_problem(self, entry: dict, seq: int, prev: str) -> str | None:
        if "hash" not in entry and seq == 1:
            raise LedgerError(
                f"ledger {self.path} is in format 1 (no hash chain, no source positions); run "
                f"`panagg ledger migrate --state-dir {self.path.parent}` once (it keeps the "
                "original as ledger.jsonl.v1)"
            )
        for field, kind in _CHAINED.items():
            if not isinstance(entry.get(field), kind) or isinstance(entry.get(field), bool):
                return f"has no valid {field!r} (the hash chain)"
        if entry["seq"] != seq:
            return f"has seq {entry['seq']} where {seq} belongs (a line was dropped or moved)"
        if entry["prev"] != prev:
            return "does not follow the line before it (a line was dropped, moved or edited)"
        if entry_hash(entry) != entry["hash"]:
            return "does not match its hash (the line was edited)"
        return None

    # -- the chain's head and its anchors ------------------------------------------------------
    def head(self) -> dict:
        """``{"seq": n, "hash": h}`` of the last entry (seq 0: an empty ledger)."""
        if not self.entries:
            return {"seq": 0, "hash": GENESIS}
        return {"seq": self.entries[-1]["seq"], "hash": self.entries[-1]["hash"]}

    def anchor_problem(self, anchor: dict | None) -> str | None:
        """Why this ledger cannot be the one ``anchor`` (a head recorded elsewhere) was taken
        from; None if it contains that entry."""
        if not anchor or int(anchor.get("seq", 0)) <= 0:
            return None
        seq, want = int(anchor["seq"]), str(anchor.get("hash", ""))
        if not self.path.exists():
            return f"the ledger {self.path} is missing, but it had {seq} entries"
        if seq > len(self.entries):
            torn = (
                " (its torn last line was complete)"
                if self.torn_tail and seq == len(self.entries) + 1
                else ""
            )
            return (
                f"the ledger {self.path} ends at entry {len(self.entries)}, but it had at "
                f"least {seq}{torn}: it was truncated or rolled back"
            )
        if not self.entries[seq - 1]["hash"].startswith(want):
            return (
                f"the ledger {self.path} differs from it at entry {seq}: it was replaced or "
                "rewritten"
            )
        return None

    # -- queries -------------------------------------------------------------------------------
    def has(self, entry_id: str) -> bool:
        return entry_id in self._by_id

    def get(self, entry_id: str) -> dict | None:
        return self._by_id.get(entry_id)

    def spent(self, window_uid: str | None = None) -> float:
        """Epsilon spent in total, or by the window with uid ``window_uid``."""
        return sum(
            e["epsilon_spent"]
            for e in self.entries
            if window_uid is None or e.get("window_uid") == window_uid
        )

    def releases(self) -> list[dict]:
        return [e for e in self.entries if e["kind"] == "release"]

    def identity(self) -> dict | None:
        """The settings the state directory was last recorded with."""
        ids = [e for e in self.entries if e["kind"] == "identity"]
        return ids[-1]["identity"] if ids else None

    def charges(self, others=()) -> ChargeBook:
        """The per-position charges of this ledger plus ``others`` (entries of the other
        aggregations of the stream)."""
        return ChargeBook([*self.entries, *others])

    def check_release(
        self,
        window_uid: str,
        epsilon: float,
        *,
        window=None,
        ranges: dict | None = None,
        lineage: str | None = None,
        window_kind: str | None = None,
        others=(),
        pending: float = 0.0,
        parallel: dict | None = None,
    ) -> None:
        """Raise BudgetExceeded if releasing the window ``window_uid`` (covering the source
        ``ranges``) at ``epsilon`` would go over budget. Call it before drawing any noise.
        ``pending``: epsilon of releases granted but not ledgered yet (in the release worker)."""
        name = f"window {window}" if window is not None else f"window {window_uid}"
        if self.spent(window_uid) + epsilon > self.budget_per_window * (1 + 1e-12):
            raise BudgetExceeded(
                f"release of {name} refused: it would spend "
                f"{self.spent(window_uid) + epsilon:g} > ledger.budget_per_window="
                f"{self.budget_per_window:g} for that window"
            )
        if ranges and epsilon > 0:
            peak = self.charges(others).peak(
                ranges, epsilon, lineage=lineage, window_kind=window_kind, parallel=parallel
            )
            if peak > self.budget_per_event * (1 + 1e-12):
                raise BudgetExceeded(
                    f"release of {name} refused: some of its events were released before "
                    f"(source positions {_ranges_text(ranges)}), and this release would bring "
                    f"them to {peak:g} eps > the per-event budget {self.budget_per_event:g} "
                    "(ledger.budget_per_event); nothing of it is published"
                )
        if (
            self.budget_total is not None
            and self.spent() + pending + epsilon > self.budget_total * (1 + 1e-12)
        ):
            raise BudgetExceeded(
                f"release of {name} refused: total spent would be "
                f"{self.spent() + pending + epsilon:g} "
                f"> ledger.budget_total={self.budget_total:g}; the budget is spent (a higher "
                "budget must be accepted explicitly, docs/operations.md)"
            )

    def check_rollup(self, rollup: str, base_uids, *, aggregation: str = "") -> list[dict]:
        """The ledger's answer for a rollup over the base windows ``base_uids``: their
        ``release`` entries (in window order), or BudgetExceeded (one line) if any is not a
        ledgered release of this aggregation. A rollup spends no epsilon (post-processing of
        those releases' views, docs/privacy.md section 21), so it may only cover releases."""
        out = []
        for uid in base_uids:
            entry = self.get(f"release-{uid}")
            if entry is None or entry.get("kind") != "release":
                raise BudgetExceeded(
                    f"rollup {rollup} refused: base window {uid} is not a ledgered release "
                    "(a rollup only adds up released views); nothing of it is published"
                )
            if (entry.get("aggregation") or "") != (aggregation or ""):
                raise BudgetExceeded(
                    f"rollup {rollup} refused: base window {entry.get('window')} was released "
                    f"by aggregation {entry.get('aggregation')!r}, not {aggregation!r}"
                )
            out.append(entry)
        return sorted(out, key=lambda e: e["seq"])

    def remaining(self) -> float | None:
        """Epsilon left under ``budget_total`` (None: no cap)."""
        if self.budget_total is None:
            return None
        return max(0.0, self.budget_total - self.spent())

    # -- appending -----------------------------------------------------------------------------
    def chained_entry(
        self,
        *,
        entry_id: str,
        kind: str,
        window=None,
        epsilon_spent: float = 0.0,
        model: str = "",
        note: str = "",
        **extra,
    ) -> dict:
        """The next entry of the chain (seq, prev and hash after the current head)."""
        head = self.head()
        entry = {
            "id": entry_id,
            "kind": kind,
            "window": window,
            "epsilon_spent": float(epsilon_spent),
            "model": model,
            "time_unix": time.time(),
        }
        if note:
            entry["note"] = note
        entry.update(extra)
        entry.update(seq=head["seq"] + 1, prev=head["hash"])
        entry["hash"] = entry_hash(entry)
        return entry

    def append(
        self,
        *,
        entry_id: str,
        kind: str,
        window=None,
        epsilon_spent: float = 0.0,
        model: str = "",
        note: str = "",
        **extra,
    ) -> bool:
        """Record an entry durably; returns False if an entry with that id is already there."""
        if entry_id in self._by_id:
            return False
        entry = self.chained_entry(
            entry_id=entry_id,
            kind=kind,
            window=window,
            epsilon_spent=epsilon_spent,
            model=model,
            note=note,
            **extra,
        )
        failpoint(f"ledger-before-{kind}")
        _write_line(self.path, json.dumps(entry, sort_keys=True, allow_nan=False) + "\n")
        failpoint(f"ledger-after-{kind}")
        self.entries.append(entry)
        self._by_id[entry_id] = entry
        self.torn_tail = False
        for listener in self.listeners:  # the budget registry (release_gate.py)
            listener(entry)
        return True


def sibling_ledger_paths(directory: str | os.PathLike) -> list[Path]:
    """The ledgers of the other aggregations of ``directory``'s set (its siblings' ledgers, and
    a one-aggregation ledger at the top, which the set refuses to start over): their charges
    count against the same stream's per-event and per-user budgets."""
    here = Path(directory).resolve()
    return [
        path
        for path in sorted([*here.parent.glob("*/ledger.jsonl"), *here.parent.glob("ledger.jsonl")])
        if path.parent.resolve() != here
    ]


def _ranges_text(ranges: dict) -> str:
    return ", ".join(f"{p} [{int(a)}, {int(b)})" for p, (a, b) in sorted(ranges.items()))


def _write_line(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                # a torn line from a crash mid-append: that append never completed (its
                # fsync had not returned), so cut it off rather than leave a damaged line
                f.truncate(_last_newline(f, end) + 1)
        f.write(line.encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())


def migrate(path: str | os.PathLike) -> int:
    """Rewrite a format-1 ledger with the hash chain and, for releases, the source ranges their
    ``end_offsets`` imply (each window starts where the one before it ended; the first at the
    start of the input). The original is kept as ``ledger.jsonl.v1``. Returns the number of
    entries."""
    path = Path(path)
    backup = path.with_name(path.name + ".v1")
    if backup.exists():
        raise LedgerError(f"{backup} exists already: a migration ran before; move it away first")
    entries = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise LedgerError(
                f"ledger {path} line {number} is not a JSON entry; restore the "
                "file from a backup before migrating"
            ) from None
        if "hash" in entry:
            raise LedgerError(f"ledger {path} is already in format 2")
        entries.append(entry)
    ends: dict[str, int] = {}
    prev = GENESIS
    out = []
    for seq, entry in enumerate(entries, start=1):
        if entry.get("kind") == "fresh-start":  # format 1 started such runs at the beginning
            ends = {}
        if entry.get("kind") in ("release", "refused") and entry.get("end_offsets"):
            entry.setdefault(
                "ranges",
                {p: [int(ends.get(p, 0)), int(o)] for p, o in entry["end_offsets"].items()},
            )
            ends.update({p: int(o) for p, o in entry["end_offsets"].items()})
        entry.update(seq=seq, prev=prev, migrated_from=1)
        entry["hash"] = entry_hash(entry)
        prev = entry["hash"]
        out.append(json.dumps(entry, sort_keys=True, allow_nan=False) + "\n")
    os.link(path, backup)
    atomic_write(path, "".join(out), mode=None)
    return len(out)


def _last_newline(f, end: int, chunk: int = 1 << 16) -> int:
    """Position of the last newline before ``end`` in the open file ``f`` (-1 if none)."""
    pos = end
    while pos > 0:
        start = max(0, pos - chunk)
        f.seek(start)
        found = f.read(pos - start).rfind(b"\n")
        if found >= 0:
            return start + found
        pos = start
    return -1
