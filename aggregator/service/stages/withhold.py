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

Event time (``window.kind = event_time``): a deleted record's timestamp is gone with it, so any
window from the open one up to the window of now + ``window.max_future_skew_s`` (a later stamp
is rejected; :func:`.retention.lost_through`, what a group's event-time close uses) may have
held it. :func:`mark_lost` notes the deleted records and that last window on the open window
(``window["lost"]``, in its checkpoints: a restart withholds it too); each window closed with
the note (:func:`lost_spans`) is withheld naming them (:meth:`.close.Closer.withhold_lost`) and
hands the note on to the next window while that can still hold one (:func:`carry_lost`). One
WARNING line when the deletion is seen; each withheld window after it logs at INFO.

Durable writes: the one ledger entry, through ``append``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from typing import TypeGuard

from ..release_gate import ReleaseGate
from ..window import WindowTask
from .retention import deleted_text, lost_through

__all__ = ["carry_lost", "deleted_note", "lost_spans", "mark_lost", "note_lost", "withhold_window"]

log = logging.getLogger("panagg.service")


def deleted_note(gone: dict[str, tuple[int, int]] | list[tuple[str, int, int]]) -> str:
    """The deleted records ``{"topic:p": (from, to)}`` (or ``[(topic:p, from, to), ...]``) in
    the words of every mode."""
    spans = (
        sorted(gone) if isinstance(gone, list) else sorted((p, a, b) for p, (a, b) in gone.items())
    )
    return "; ".join(
        deleted_text(p.rsplit(":", 1)[0], int(p.rsplit(":", 1)[1]), a, b)
        for p, a, b in spans
        if b > a
    )


def mark_lost(
    window: dict,
    gone: dict[str, tuple[int, int]],
    *,
    size_s: float,
    skew_s: float,
    now: float | None = None,
) -> int:
    """Note on the event-time ``window`` that the records ``gone`` were deleted before they
    were counted: it and every later window up to the one returned (an event index: the window
    of now + ``skew_s``) may have held one. A note already there is extended."""
    now = time.time() if now is None else now
    through = lost_through(
        int(now * 1000),
        size_ms=int(round(float(size_s) * 1000)),
        skew_ms=int(round(float(skew_s) * 1000)),
    )
    old = window.get("lost") or {}
    spans = [list(s) for s in old.get("spans", [])]
    spans += [
        [p, int(a), int(b)]
        for p, (a, b) in sorted(gone.items())
        if int(b) > int(a) and [p, int(a), int(b)] not in spans
    ]
    window["lost"] = {"through": max(int(old.get("through", through)), through), "spans": spans}
    return window["lost"]["through"]


def note_lost(task: WindowTask, gone: dict[str, tuple[int, int]], wcfg, seen: str) -> None:
    """The records ``gone`` of ``task``'s event-time window were deleted before they were
    counted (``seen``: where): note them on the window (:func:`mark_lost`), go on from the
    first records left, and say so in one WARNING line."""
    through = mark_lost(task.window, gone, size_s=wcfg.size, skew_s=wcfg.max_future_skew_s)
    task.offsets.update({p: int(b) for p, (_, b) in gone.items()})
    end = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((through + 1) * float(wcfg.size)))
    log.warning(
        "%s (%s): window %s of %s and every later event-time window that may hold one "
        "(to the window ending at %s: now + window.max_future_skew_s) are withheld, "
        "nothing of them is published; counting goes on from the first records left. "
        "Raise the topic's retention.ms above the longest stall",
        deleted_note(gone),
        seen,
        task.window["id"],
        task.name,
        end,
    )


def _may_hold(lost: dict | None, window: dict) -> TypeGuard[dict]:
    """Whether ``window`` may hold a record of the note ``lost`` (:func:`mark_lost`): there is
    a note and the window's event index (None: not known yet) is not past its last window."""
    if not lost:
        return False
    index = window.get("event_index")
    return index is None or int(index) <= int(lost["through"])


def lost_spans(window: dict) -> list[tuple[str, int, int]]:
    """The deleted records ``window`` may have held (:func:`mark_lost`): it is withheld naming
    them; empty if it cannot have held one (its event index is past the note's last window)."""
    lost = window.get("lost")
    if _may_hold(lost, window):
        return [(str(p), int(a), int(b)) for p, a, b in lost["spans"]]
    return []


def carry_lost(closed: dict, window: dict) -> None:
    """Hand the note of deleted records (:func:`mark_lost`) from the ``closed`` window on to
    the next ``window`` while that may still hold one of them."""
    lost = closed.get("lost")
    if _may_hold(lost, window):
        window["lost"] = copy.deepcopy(lost)
    else:
        window.pop("lost", None)


def withhold_window(
    task: WindowTask,
    gone: dict[str, tuple[int, int]] | list,
    *,
    gate: ReleaseGate,
    append: Callable[..., object],
    model: str,
    ranges: dict,
    ends: dict,
    totals: dict,
    events: int,
    seen: str,
    window: dict | None = None,
    extra: dict | None = None,
    warn: bool = True,
) -> str:
    """Ledger ``task``'s open window (or ``window``, closing) as withheld: a ``refused`` entry
    naming the deleted records ``gone``, covering ``ranges`` (what the window counted:
    ``events``) and ending at ``ends`` with ``totals`` there (and ``extra`` fields); ``seen``
    says where the deletion was seen and what follows (in the note). One WARNING line (INFO
    without ``warn``). Returns the note's words for the deleted records."""
    window = task.window if window is None else window
    wid, uid = window["id"], window["uid"]
    note = deleted_note(gone)
    fields = gate.position_fields(dict(window, events=int(events)), ranges, ends, totals)
    append(
        entry_id=f"refused-{uid}",
        kind="refused",
        window=wid,
        window_uid=uid,
        model=model,
        note=f"{note} ({seen})",
        **fields,
        **(extra or {}),
    )
    log.log(
        logging.WARNING if warn else logging.INFO,
        "window %s of %s is withheld: %s; nothing of it is published",
        wid,
        task.name,
        note,
    )
    return note
