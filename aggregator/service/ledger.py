"""The privacy ledger: an append-only record of every release and audit export.

Each line of ``ledger.jsonl`` is one JSON entry (id, kind, window, epsilon spent, model, time),
written with fsync. Entries are idempotent by id, so re-publishing a release after a crash never
records (or spends) it twice. A release that would exceed the configured budget is refused with
:class:`BudgetExceeded` before any noise is drawn for it.

Accounting (see docs/privacy.md): windows hold disjoint events, so each window's state is
epsilon-DP on its own (parallel composition). A window's release spends that window's epsilon;
announced audit exports, separated from every other view by fresh layers, spend nothing extra.
``budget_per_window`` (default: epsilon) therefore allows exactly one release per window;
``budget_total`` (optional) caps the sum over all releases for users who account across windows.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = ["Ledger", "BudgetExceeded"]


class BudgetExceeded(RuntimeError):
    """The release would spend more epsilon than the configured budget."""


class Ledger:
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
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    try:
                        self.entries.append(json.loads(line))
                    except json.JSONDecodeError:
                        # a torn last line from a crash mid-append: ignore it; the entry is
                        # re-appended when its release is re-published
                        continue
        self._ids = {e["id"] for e in self.entries}

    def has(self, entry_id: str) -> bool:
        return entry_id in self._ids

    def spent(self, window=None) -> float:
        return sum(e["epsilon_spent"] for e in self.entries
                   if window is None or e["window"] == window)

    def check_release(self, window, epsilon: float, entry_id: str | None = None) -> None:
        """Raise BudgetExceeded if releasing ``window`` at ``epsilon`` would go over budget.

        An ``entry_id`` already in the ledger passes: that release was recorded but never
        published (a crash in between), so computing it again publishes it once.
        """
        if entry_id is not None and entry_id in self._ids:
            return
        if self.spent(window) + epsilon > self.budget_per_window * (1 + 1e-12):
            raise BudgetExceeded(
                f"release of window {window} refused: it would spend {self.spent(window) + epsilon:g} "
                f"> ledger.budget_per_window={self.budget_per_window:g} for that window")
        if self.budget_total is not None and self.spent() + epsilon > self.budget_total * (1 + 1e-12):
            raise BudgetExceeded(
                f"release of window {window} refused: total spent would be {self.spent() + epsilon:g} "
                f"> ledger.budget_total={self.budget_total:g}; raise ledger.budget_total to continue")

    def append(self, *, entry_id: str, kind: str, window, epsilon_spent: float, model: str,
               note: str = "") -> bool:
        """Record an entry durably; returns False if it was already there."""
        if entry_id in self._ids:
            return False
        entry = {"id": entry_id, "kind": kind, "window": window, "epsilon_spent": float(epsilon_spent),
                 "model": model, "time_unix": time.time()}
        if note:
            entry["note"] = note
        line = json.dumps(entry, sort_keys=True) + "\n"
        with open(self.path, "a+b") as f:
            f.seek(0, os.SEEK_END)
            if f.tell():
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a torn line from a crash mid-append: end it first
                    line = "\n" + line
            f.write(line.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        self.entries.append(entry)
        self._ids.add(entry_id)
        return True
