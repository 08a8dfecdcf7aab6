"""One pan-private state with its window, offsets and checkpoint: the unit the service runs.

The single-process service has one :class:`WindowTask` over every source partition; scale-out has
one per Kafka partition. Both run the same code (:class:`aggregator.service.process.Aggregator`)
for counting, snapshots, restores, window closes and checkpoints, so there is one set of
semantics and one set of tests.

Views of the state (docs/privacy.md, "Every copy of the state counts"). The live counters are a
view an intruder can read at any time; so is every file under the state directory and every copy
of it. Two views of the same noise at two times reveal the exact events between them. So:

* the open window's counters live **only in memory**. A checkpoint normally carries no counters:
  it holds where the window starts in the source (offsets), the totals up to there and releases
  not yet published. After a crash, a stop or a handover the window is rebuilt by **replaying**
  it from the source under fresh noise;
* a checkpoint *with* counters (an optional snapshot, ``checkpoint.snapshots_per_window``, or the
  one an audit export leaves) is written like an announced export: a fresh DLap layer on the live
  counters, the snapshot, another fresh layer. Every view is then separated from the previous
  one by a layer the later view carries, and each event falls in exactly one difference of
  consecutive views;
* restoring a snapshot adds a fresh layer before counting resumes, so the memory after a restart
  never equals the file plus exact increments.

Window bookkeeping: ``window`` holds the number, a random ``uid`` (the ledger's key for the
window), the kind and size, the events counted and the start time; ``offsets`` the next source
offset per partition that the live counters include; ``durable`` the last checkpoint written.
"""

from __future__ import annotations

import copy
import os
import time

from state_store.local import Checkpoint, LocalStore

from ..state import PanPrivateHistogram

__all__ = ["WindowTask", "new_window", "window_uid", "totals_from"]


def window_uid() -> str:
    """A random window id (the ledger's key for a window; never reused across restarts)."""
    return os.urandom(8).hex()


def new_window(
    window_id: int, kind: str, size, *, started_unix: float | None = None, uid: str | None = None
) -> dict:
    return {
        "id": int(window_id),
        "uid": uid or window_uid(),
        "kind": kind,
        "size": size,
        "events": 0,
        "snapshots": 0,
        "started_unix": time.time() if started_unix is None else float(started_unix),
    }


def totals_from(recorded: dict) -> dict:
    """Totals (events, rejects by reason, filtered) as the service keeps them, from a
    checkpoint's or a ledger entry's copy."""
    return {
        "events": int(recorded.get("events", 0)),
        "rejects": dict(recorded.get("rejects", {})),
        "filtered": int(recorded.get("filtered", 0)),
    }


class WindowTask:
    """State, window, offsets, totals and checkpoint store of one unit of counting.

    Parameters
    ----------
    name
        ``"all"`` for the single-process service, the partition key in scale-out.
    store
        The checkpoint store of this unit.
    """

    def __init__(self, name: str, store: LocalStore | None = None):
        self.name = name
        self.store = store
        self.state: PanPrivateHistogram | None = None
        self.window: dict = {}
        self.offsets: dict[str, int] = {}
        self.pending: list[str] = []
        self.totals: dict = {"events": 0, "rejects": {}}
        self.durable: Checkpoint | None = None
        #: replay target: close the window once the offsets reach these (a time window whose
        #: end passed while the process was down, or a window the ledger already released)
        self.close_at: dict[str, int] | None = None
        #: closed windows handed to the release worker, in window order: each {"window",
        #: "start" ({"offsets", "totals"} of the checkpoint that started it), "end_offsets",
        #: "totals" (at its end), "ranges", "charge", "future"}; their counters are in memory only
        self.inflight: list[dict] = []
        #: after a restart: closed, unreleased windows still to replay (and, last, the open
        #: window), each {"window", "end_offsets", "totals"} (the open one: no end)
        self.queue: list[dict] = []
        #: where the open window starts ({"offsets", "totals"}): what a checkpoint taken while
        #: it counts (a release collected meanwhile) records as its start
        self.window_start: dict | None = None
        #: a window that started with events counted already (an event-time window that was the
        #: second live one): ``{"offsets": ..., "events": n}``, where a checkpoint that starts it
        #: must replay those n events from (it holds no counters); None otherwise
        self.replay: dict | None = None

    def live_state(self) -> PanPrivateHistogram:
        """The open window's state (a window that counts has one; the user unit's is a
        density state with the same counting calls: user_window.py)."""
        if self.state is None:
            raise RuntimeError(f"unit {self.name!r}: no window's state is open")
        return self.state

    def checkpoints(self) -> LocalStore:
        """This unit's checkpoint store (set before the first window opens)."""
        if self.store is None:
            raise RuntimeError(f"unit {self.name!r}: no checkpoint store")
        return self.store

    # -- progress through the window -----------------------------------------------------------
    def room(self) -> int | None:
        """Events the current count window still takes (None: not a count window)."""
        if self.window["kind"] != "count":
            return None
        return int(self.window["size"]) - int(self.window["events"])

    def progress(self, now: float | None = None) -> float:
        w = self.window
        if w["kind"] == "count":
            return w["events"] / w["size"]
        now = time.time() if now is None else now
        return max(0.0, (now - w["started_unix"]) / w["size"])

    def reached(self, target: dict[str, int]) -> bool:
        return all(self.offsets.get(p, -1) >= off for p, off in target.items())

    def mark_start(self) -> None:
        """The open window starts here: what a checkpoint taken while it counts records."""
        self.window_start = {"offsets": dict(self.offsets), "totals": copy.deepcopy(self.totals)}

    def count_rejects(self, reasons: dict[str, int]) -> None:
        rejects = self.totals["rejects"]
        for reason, count in reasons.items():
            rejects[reason] = rejects.get(reason, 0) + int(count)

    # -- checkpoints ---------------------------------------------------------------------------
    def record(self, snapshot: bytes | None) -> Checkpoint:
        """The checkpoint of the live position (with ``snapshot`` counters, or none; without
        counters, the window's start: see ``replay``)."""
        window, offsets, totals = (
            copy.deepcopy(self.window),
            dict(self.offsets),
            copy.deepcopy(self.totals),
        )
        if snapshot is None and self.replay is not None:
            # the events counted before the window started are not in the checkpoint: a
            # restart counts them again from where their records start
            offsets = dict(self.replay["offsets"])
            window["events"] -= self.replay["events"]
            totals["events"] -= self.replay["events"]
        return Checkpoint(
            state=snapshot,
            window=window,
            offsets=offsets,
            pending=list(self.pending),
            totals=totals,
        )

    def record_position(self) -> Checkpoint:
        """The checkpoint while closed windows wait for their release or the open window has
        counted events (releases beside the loop): no counters; the replay starts where the
        first unreleased window (or else the open window) starts, and the closed, unreleased
        windows are listed with their ends, so a restart replays and closes each of them."""
        start = self.inflight[0]["start"] if self.inflight else self.window_start
        window = copy.deepcopy(self.window)
        window["events"] = 0
        unreleased = [
            {
                "window": j["window"],
                "end_offsets": dict(j["end_offsets"]),
                "totals": copy.deepcopy(j["totals"]),
            }
            for j in self.inflight
        ]
        return Checkpoint(
            state=None,
            window=window,
            offsets=dict(start["offsets"]),
            pending=list(self.pending),
            totals=copy.deepcopy(start["totals"]),
            unreleased=unreleased,
        )

    def rewrite_pending(self) -> Checkpoint:
        """The last durable checkpoint with the current pending list: no new view of the state
        (same counters or none, same offsets), only the publishing progress changes."""
        d = self.durable
        return Checkpoint(
            state=d.state,
            window=d.window,
            offsets=d.offsets,
            pending=list(self.pending),
            totals=d.totals,
            unreleased=list(d.unreleased),
        )
