"""The privacy ledger: the append-only authority on what was released and what it cost.

Each line of ``ledger.jsonl`` is one JSON entry, written with fsync before the thing it records
becomes visible. Kinds:

``identity``
    What the state directory counts and under which settings (stream, mode, domain, epsilon,
    window, budget). Written once at the first start; a later start with other settings is
    refused unless the change is accepted explicitly, which appends a new ``identity`` entry
    carrying the previous one (so a lifted budget is on record).
``release``
    One window's release: its number, its random ``window_uid`` (drawn when the window opens and
    kept in the checkpoint), the epsilon spent, the release document itself and the source
    offsets the window ends at. A window already ledgered is re-published from this document,
    never computed again (a second computation would draw a second release layer).
``refused``
    A release the budget did not allow (nothing was computed, no noise was drawn for it).
``export``, ``restart``, ``fresh-start``
    Announced audit exports (epsilon 0: fresh layers before and after), restarts that replayed
    part of a window (the events re-counted under fresh noise; docs/privacy.md, R3), and starts
    without a checkpoint that were explicitly allowed.

Budget: ``budget_per_window`` caps the epsilon spent per window uid (default: one release), and
``budget_total`` (optional) caps the sum over all entries. Both are checked before any release
noise is drawn. Windows are keyed by their random uid, not their number, so restarting the
numbering (a moved-away checkpoint) cannot reuse a spent window's budget.

A damaged ledger (a line that is not a JSON entry, or an entry without its fields) stops the
service with one line naming the line number: silently skipping a line would under-count the
budget. The only tolerated defect is a torn last line without a newline, which a crash in the
middle of an append leaves; its entry is appended again when the operation is redone.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

__all__ = ["Ledger", "BudgetExceeded", "LedgerError"]

log = logging.getLogger("panagg.ledger")

_REQUIRED = {"id": str, "kind": str, "epsilon_spent": (int, float), "time_unix": (int, float)}


class BudgetExceeded(RuntimeError):
    """The release would spend more epsilon than the configured budget."""


class LedgerError(RuntimeError):
    """The ledger file cannot be trusted (a damaged line)."""


class Ledger:
    """The ledger file at ``path`` with its budget rules (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, *, budget_per_window: float,
                 budget_total: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.budget_per_window = float(budget_per_window)
        self.budget_total = None if not budget_total else float(budget_total)
        self.reload()

    def reload(self) -> None:
        """Re-read the file (scale-out: several processes append to one shared ledger, each
        under the merge lock)."""
        self.entries: list[dict] = []
        self._by_id: dict[str, dict] = {}
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        torn_tail = not data.endswith(b"\n")
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            last = number == len(lines)
            try:
                entry = json.loads(raw)
                problem = self._problem(entry)
            except (json.JSONDecodeError, UnicodeDecodeError):
                entry, problem = None, "is not a JSON entry"
            if problem:
                if last and torn_tail:  # a crash mid-append; the operation is redone
                    log.warning("%s: ignoring the torn last line %d (an interrupted append)",
                                self.path, number)
                    continue
                raise LedgerError(f"ledger {self.path} line {number} {problem}; the ledger is the "
                                  "record of privacy spent: restore the file from a backup "
                                  "(never delete or edit its lines)")
            self.entries.append(entry)
            self._by_id[entry["id"]] = entry

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

    # -- queries -------------------------------------------------------------------------------
    def has(self, entry_id: str) -> bool:
        return entry_id in self._by_id

    def get(self, entry_id: str) -> dict | None:
        return self._by_id.get(entry_id)

    def spent(self, window_uid: str | None = None) -> float:
        """Epsilon spent in total, or by the window with uid ``window_uid``."""
        return sum(e["epsilon_spent"] for e in self.entries
                   if window_uid is None or e.get("window_uid") == window_uid)

    def releases(self) -> list[dict]:
        return [e for e in self.entries if e["kind"] == "release"]

    def identity(self) -> dict | None:
        """The settings the state directory was last recorded with."""
        ids = [e for e in self.entries if e["kind"] == "identity"]
        return ids[-1]["identity"] if ids else None

    def check_release(self, window_uid: str, epsilon: float, *, window=None) -> None:
        """Raise BudgetExceeded if releasing the window ``window_uid`` at ``epsilon`` would go
        over budget. Call it before drawing any noise for the release."""
        name = f"window {window}" if window is not None else f"window {window_uid}"
        if self.spent(window_uid) + epsilon > self.budget_per_window * (1 + 1e-12):
            raise BudgetExceeded(
                f"release of {name} refused: it would spend "
                f"{self.spent(window_uid) + epsilon:g} > ledger.budget_per_window="
                f"{self.budget_per_window:g} for that window")
        if self.budget_total is not None and self.spent() + epsilon > self.budget_total * (1 + 1e-12):
            raise BudgetExceeded(
                f"release of {name} refused: total spent would be {self.spent() + epsilon:g} "
                f"> ledger.budget_total={self.budget_total:g}; the budget is spent (a higher "
                "budget must be accepted explicitly, docs/operations.md)")

    def remaining(self) -> float | None:
        """Epsilon left under ``budget_total`` (None: no cap)."""
        if self.budget_total is None:
            return None
        return max(0.0, self.budget_total - self.spent())

    # -- appending -----------------------------------------------------------------------------
    def append(self, *, entry_id: str, kind: str, window=None, epsilon_spent: float = 0.0,
               model: str = "", note: str = "", **extra) -> bool:
        """Record an entry durably; returns False if an entry with that id is already there."""
        if entry_id in self._by_id:
            return False
        entry = {"id": entry_id, "kind": kind, "window": window,
                 "epsilon_spent": float(epsilon_spent), "model": model,
                 "time_unix": time.time()}
        if note:
            entry["note"] = note
        entry.update(extra)
        line = json.dumps(entry, sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a+b") as f:
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
        self.entries.append(entry)
        self._by_id[entry_id] = entry
        return True


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
