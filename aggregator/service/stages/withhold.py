"""Withholding a window whose source records were deleted before they were counted.

The topic's retention can delete records the service had not read: while it was down (seen at
the start, :meth:`.resume.Resume.withhold_deleted`) or while it ran and fell behind (seen in the
loop, :meth:`.close.Closer.withhold_deleted`). The window those records belonged to cannot be
released whole. Both paths withhold it with the same ledger entry, written here: a ``refused``
entry (epsilon 0, no noise drawn) whose note names the deleted records in the words every mode
uses (:func:`.retention.deleted_text`; the fault harness's checker reads them,
tests/chaos/invariant.py), with the ranges the window did count, the end a restart resumes at
(the first records left) and the totals there; and one WARNING line naming them. Nothing of
the window is published.

Durable writes: the one ledger entry, through ``append``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..release_gate import ReleaseGate
from ..window import WindowTask
from .retention import deleted_text

__all__ = ["deleted_note", "withhold_window"]

log = logging.getLogger("panagg.service")


def deleted_note(gone: dict[str, tuple[int, int]]) -> str:
    """The deleted records ``{"topic:p": (from, to)}`` in the words of every mode."""
    return "; ".join(
        deleted_text(p.rsplit(":", 1)[0], int(p.rsplit(":", 1)[1]), a, b)
        for p, (a, b) in sorted(gone.items())
        if b > a
    )


def withhold_window(
    task: WindowTask,
    gone: dict[str, tuple[int, int]],
    *,
    gate: ReleaseGate,
    append: Callable[..., object],
    model: str,
    ranges: dict,
    ends: dict,
    totals: dict,
    events: int,
    seen: str,
) -> str:
    """Ledger ``task``'s open window as withheld: a ``refused`` entry naming the deleted
    records ``gone``, covering ``ranges`` (what the window counted: ``events``) and ending at
    ``ends`` with ``totals`` there; ``seen`` says where the deletion was seen and what follows
    (in the note). One WARNING line. Returns the note's words for the deleted records."""
    wid, uid = task.window["id"], task.window["uid"]
    note = deleted_note(gone)
    fields = gate.position_fields(dict(task.window, events=int(events)), ranges, ends, totals)
    append(
        entry_id=f"refused-{uid}",
        kind="refused",
        window=wid,
        window_uid=uid,
        model=model,
        note=f"{note} ({seen})",
        **fields,
    )
    log.warning("window %s of %s is withheld: %s; nothing of it is published", wid, task.name, note)
    return note
