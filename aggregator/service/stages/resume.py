"""Resuming a window task at a start: from its latest checkpoint, or a first window.

A checkpoint holds no live counters, so a restored window starts a fresh state (or the
checkpoint's layered snapshot plus a fresh layer) and its records after the checkpoint are
replayed from the source under fresh noise; the restart is ledgered (a ``restart`` entry: what
it costs, docs/privacy.md R3). Closed windows the checkpoint lists as unreleased (releases
beside the loop) are replayed to their recorded ends and released once
(:meth:`Resume.queue_unreleased`). A window the ledger already decided is never replayed: the
next window starts at its ledgered end (:meth:`Resume.skip_decided_window`; a replay would put
its events in memory under fresh noise beside the published release of the old noise). Without
a checkpoint (:meth:`Resume.first_start`) the first window starts at ``source.start``, never over
positions the budget has spent. An open window whose first records the topic's retention deleted
while the service was down cannot be replayed: it is withheld, its ledger entry naming the
deleted records, and the next window starts at the first records left
(:meth:`Resume.withhold_deleted`).

Invariant: a start never replays a decided window and never counts a position twice into one
window. Durable writes: ledger entries (``restart``, ``fresh-start``, ``refused``) through the
start's ``append`` (held until every check passed: a refused start writes nothing); the caller
commits the position when :meth:`Resume.restore_task` says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from ...state import PanPrivateHistogram
from ..errors import ServiceError
from ..ledger import Ledger
from ..release_gate import ReleaseGate
from ..window import WindowTask, totals_from
from .fresh_state import FreshStates
from .registries import BudgetRegistries
from .retention import deleted_spans
from .start_checks import StartChecks
from .windows import WindowAssigner
from .withhold import withhold_window

__all__ = ["Resume"]

log = logging.getLogger("panagg.service")


class Resume:
    """Where a task resumes at a start.

    Parameters
    ----------
    ledger
        The privacy ledger (decided windows, the budget's resume positions).
    checks
        The start's lineage checks (start policy, rollback, the restored state's settings).
    registries
        The budget registries (a file read before under another name or state directory).
    gate
        The release gate (charges of other aggregations).
    windows
        The window assigner (new windows, replay targets).
    source
        The event source (``committed_offsets`` where it has them).
    event_time
        The event-time windows (a decided event-time window is passed their way).
    states
        The fresh states (:mod:`.fresh_state`): a window's new state, the ``rng`` of a restored
        snapshot's fresh layer, the state's settings (a restored snapshot must match them).
    append
        ``append(**entry)``: a ledger entry of the start (held while it checks).
    model
        The counter model (in the ``restart`` entry).
    fresh_start
        ``--fresh-start``: start without the lost checkpoint.
    directory, group
        ``checkpoint.dir`` and ``source.group`` (named in refusals).
    """

    def __init__(
        self,
        ledger: Ledger,
        checks: StartChecks,
        registries: BudgetRegistries,
        gate: ReleaseGate,
        windows: WindowAssigner,
        source,
        *,
        event_time,
        states: FreshStates,
        append: Callable[..., None],
        model: str,
        fresh_start: bool,
        directory: Path,
        group: str,
    ):
        self.ledger, self.checks, self.registries, self.gate = ledger, checks, registries, gate
        self.windows, self.source, self.event_time = windows, source, event_time
        self.new_state, self.rng = states.take, states.rng
        #: the totals at the end of the closed window being replayed (a restart's queue)
        self.closing_totals: dict | None = None
        self.append = self.start_append = append
        self.epsilon, self.direct, self.size = states.epsilon, states.direct, states.size
        self.model = model
        self.fresh_start, self.dir, self.group = fresh_start, directory, group

    def restore_task(self, task: WindowTask, *, where: str) -> bool:
        """Resume ``task`` from its latest checkpoint (see :mod:`.window`): a fresh state (or
        the checkpoint's snapshot plus a fresh layer), the window, offsets and totals. A window
        the ledger already decided (released or refused) is not replayed: the next window
        starts at its ledgered end. True: the caller must commit the position set (no
        checkpoint holds it yet: a first start, or a window passed)."""
        ckpt = task.checkpoints().load_latest()
        if ckpt is None:
            self.first_start(task, where)
            return True
        self.checks.check_start_policy(where)
        self.checks.check_not_rolled_back(ckpt.window, where)
        task.window, task.offsets = dict(ckpt.window), dict(ckpt.offsets)
        task.pending = list(ckpt.pending)
        task.totals = totals_from(ckpt.totals)
        task.window.setdefault("uid", f"v1-{task.name}-{task.window['id']}")
        task.window.setdefault("snapshots", 0)
        # checkpoints from before source ranges: the window starts at the checkpoint's offsets
        # (a snapshot's are mid-window: its partitions' first records then mark the start)
        task.window.setdefault("start_offsets", dict(ckpt.offsets) if ckpt.state is None else {})
        task.window.setdefault("lineage", f"legacy-{(self.ledger.identity() or {}).get('run')}")
        task.durable, task.replay = ckpt, None
        task.queue, task.inflight = [], []
        if ckpt.unreleased:
            self.queue_unreleased(task, ckpt)
        elif self.skip_decided_window(task):
            return True
        task.mark_start()
        if ckpt.state is None:
            task.state = self.new_state(task, task.window["id"])
        else:
            task.state = PanPrivateHistogram.deserialize(ckpt.state)
            self.checks.check_state_matches_config(
                task.state,
                f"the checkpoint in {where}",
                direct=self.direct,
                size=self.size,
                epsilon=self.epsilon,
            )
            # the restored memory must not equal the file plus exact increments
            task.state.rerandomize(rng=self.rng(3, task.window["id"], ckpt.seq))
            # where this window's records start is behind the snapshot (and the totals there
            # are not known): its close runs in the loop, which needs neither
            task.window_start = None
        if task.close_at is None:
            self.windows.replay_target(task)
        # what the restart costs (docs/privacy.md, R3): the events counted after this checkpoint
        # before the stop are counted again under fresh noise
        self.append(
            entry_id=f"restart-{os.urandom(6).hex()}",
            kind="restart",
            window=task.window["id"],
            window_uid=task.window["uid"],
            model=self.model,
            replay_from=dict(task.offsets),
            unit=task.name,
            note="events after replay_from counted again under fresh noise; "
            "2 eps for them against an intruder who read memory before "
            "the restart",
        )
        if task.window["kind"] == "event_time":
            self.event_time.restored()
        log.info(
            "restored checkpoint %d of %s: window %s from %d partition offset(s)%s; the "
            "window's later events are replayed from the source under fresh noise",
            ckpt.seq,
            task.name,
            task.window["id"],
            len(task.offsets),
            " and a layered snapshot" if ckpt.state is not None else "",
        )
        return False

    def withhold_deleted(self, task: WindowTask) -> bool:
        """If the topic's retention deleted records of a restored window before they were
        counted (the service was down longer than the retention), withhold that window: a
        ``refused`` entry names the deleted records (the words of every mode,
        :func:`.retention.deleted_text`), and counting goes on after it. A closed window the
        checkpoint still had to release is withheld over its whole recorded extent (its ranges),
        and the next one is looked at in turn; the open window is withheld over the deleted
        records only, and the next window starts at the first records left. Without it the
        start was refused until an operator moved the checkpoints away, and a supervisor
        restarting the service looped on that refusal. The entry is the one a running service
        writes when it finds its unread records deleted (:func:`.withhold.withhold_window`). A
        snapshot's replay and event-time windows keep the refusal (the start's replay check).
        True if any was withheld."""
        if task.window.get("kind") == "event_time" or (
            task.durable is not None and task.durable.state is not None
        ):
            return False
        withheld = False
        while self.ledger.get(f"release-{task.window['uid']}") is None:
            gone = deleted_spans(self.source, task.offsets)
            if not gone:
                break
            withheld = True
            wid = task.window["id"]
            closed = dict(task.close_at) if task.queue and task.close_at else None
            if closed is not None:  # a closed window: its extent is recorded
                gone = {p: (a, min(b, closed.get(p, b))) for p, (a, b) in gone.items()}
                ends = dict(task.offsets, **closed)
                ranges = {
                    p: [int(task.offsets.get(p, e)), int(e)]
                    for p, e in closed.items()
                    if int(e) > int(task.offsets.get(p, e))
                }
                totals = totals_from(self.closing_totals) if self.closing_totals else task.totals
            else:
                ends = dict(task.offsets, **{p: b for p, (_, b) in gone.items()})
                ranges, totals = {}, task.totals
            withhold_window(
                task,
                gone,
                gate=self.gate,
                append=self.append,
                model=self.model,
                ranges=ranges,
                ends=ends,
                totals=totals,
                events=0,
                seen="seen at a restart: the window cannot be replayed; counting goes on after it",
            )
            task.offsets, task.totals = ends, totals
            if task.queue:  # the next window the checkpoint listed (the last: the open one)
                nxt = task.queue.pop(0)
                task.window = dict(nxt["window"], events=0)
                task.close_at = (
                    {p: int(o) for p, o in nxt["end_offsets"].items()}
                    if nxt.get("end_offsets") is not None
                    else None
                )
                self.closing_totals = nxt.get("totals")
                task.window["start_offsets"] = dict(task.offsets)
            else:
                lineage = task.window["lineage"]
                task.window = self.windows.new_window(task, wid + 1)
                task.window.update(lineage=lineage, start_offsets=dict(task.offsets))
                task.close_at = None
            task.mark_start()
            task.state = self.new_state(task, task.window["id"])
            if task.close_at is None and task.window.get("kind") == "time":
                self.windows.replay_target(task)  # ended while the service was down
        return withheld

    def queue_unreleased(self, task: WindowTask, ckpt) -> None:
        """The checkpoint lists closed windows whose release was not ledgered when it was
        written (releases beside the loop): replay each from its start to its recorded end and
        close it, then the open window. Those the ledger holds by now are not replayed: the
        replay starts at the end of the last of them."""
        queue = [dict(u) for u in ckpt.unreleased] + [
            {"window": dict(ckpt.window), "end_offsets": None}
        ]
        while len(queue) > 1:
            uid = queue[0]["window"]["uid"]
            entry = self.ledger.get(f"release-{uid}") or self.ledger.get(f"refused-{uid}")
            if entry is None:
                break
            if entry["kind"] == "release" and entry["document"] not in task.pending:
                task.pending.append(entry["document"])
            head = queue.pop(0)
            task.offsets = dict(task.offsets, **{p: int(o) for p, o in head["end_offsets"].items()})
            task.totals = totals_from(head["totals"])
        first = queue.pop(0)
        self.closing_totals = first.get("totals")  # at its end (withhold_deleted reads it)
        task.window = dict(first["window"], events=0)
        task.close_at = (
            {p: int(o) for p, o in first["end_offsets"].items()}
            if first.get("end_offsets") is not None
            else None
        )
        task.queue = queue
        closed = (task.close_at is not None) + sum(q.get("end_offsets") is not None for q in queue)
        log.info(
            "%d closed window(s) of %s were not released when the service stopped: each "
            "is replayed from the source and released once",
            closed,
            task.name,
        )

    def skip_decided_window(self, task: WindowTask) -> bool:
        """If the ledger already holds the restored window's release (or refusal) with its end
        positions and totals (a stop between the ledger entry and the checkpoint that starts the
        next window), start the next window at that end instead of replaying this one: a replay
        would put the window's events in memory under fresh noise beside the published release
        of the old noise (two looks at them). True if skipped."""
        uid = task.window["uid"]
        entry = self.ledger.get(f"release-{uid}") or self.ledger.get(f"refused-{uid}")
        if entry is None or entry.get("end_offsets") is None or entry.get("totals") is None:
            return False
        wid = task.window["id"]
        if task.window["kind"] == "event_time":
            if not self.event_time.skip_decided_window(task, entry):
                return False
            if entry["kind"] == "release" and entry["document"] not in task.pending:
                task.pending.append(entry["document"])
            log.info(
                "window %s of %s is in the ledger already (%s): it is not replayed; window "
                "%s starts after it",
                wid,
                task.name,
                entry["kind"],
                wid + 1,
            )
            return True
        if entry["kind"] == "release" and entry["document"] not in task.pending:
            task.pending.append(entry["document"])
        ends = {p: int(o) for p, o in entry["end_offsets"].items()}
        task.offsets = dict(task.offsets, **ends)
        task.totals = totals_from(entry["totals"])
        lineage = task.window["lineage"]
        task.window = self.windows.new_window(task, wid + 1)
        task.window.update(lineage=lineage, start_offsets=dict(task.offsets))
        task.mark_start()
        task.state = self.new_state(task, wid + 1)
        task.close_at = None
        log.info(
            "window %s of %s is in the ledger already (%s): it is not replayed; window %s "
            "starts at its end",
            wid,
            task.name,
            entry["kind"],
            wid + 1,
        )
        return True

    def first_start(self, task: WindowTask, where: str) -> None:
        """No checkpoint: the first window, at ``source.start`` (or after the last released
        position, or the committed offsets with --fresh-start); refused when the ledger or the
        consumer group shows that a checkpoint existed."""
        released = [e for e in self.ledger.entries if e["kind"] in ("release", "refused")]
        first = 0
        committed: dict = getattr(self.source, "committed_offsets", lambda: {})()
        if committed and not released and not self.fresh_start:
            raise ServiceError(
                f"no checkpoint in {where}, but consumer group {self.group!r} "
                "has committed offsets: another state directory (or a lost one) counted this "
                "topic. Use that state directory, another source.group, or --fresh-start to "
                "count from the committed offsets"
            )
        if released:
            if not self.fresh_start:
                raise ServiceError(
                    f"no checkpoint in {where}, but the ledger in {self.dir} records "
                    f"{len(released)} release(s): the checkpoint was lost or moved away. Restore "
                    "it from a backup, or start with --fresh-start (the window it held is then "
                    "never released)"
                )
            first = max(int(e["window"]) for e in released if isinstance(e.get("window"), int)) + 1
        task.window = self.windows.new_window(task, first)
        task.state = self.new_state(task, first)
        task.offsets, task.pending = {}, []
        task.totals = {"events": 0, "rejects": {}}
        task.durable = None
        task.offsets, at = self.checks.start_offsets(bool(committed))
        # never over positions whose events this release would charge past the budget (a
        # fresh start, an aggregation renamed or added under --accept-change)
        resume = self.ledger.charges(self.gate.other_charges()).resume_offsets(
            self.epsilon, budget=self.ledger.budget_per_event
        )
        # the same content read before (renamed, another state dir)
        self.registries.resume_after_file(resume, self.epsilon, self.ledger.budget_per_event)
        floor = dict(committed) if committed and self.fresh_start else {}
        floor.update(task.offsets)
        later = {p: o for p, o in resume.items() if o > floor.get(p, 0)}
        if later:
            task.offsets.update(later)
            at = (
                "after the last released position ("
                + ", ".join(f"{k} at {v}" for k, v in sorted(later.items()))
                + f"), not at {at}"
            )
        task.window.update(lineage=os.urandom(8).hex(), start_offsets=dict(task.offsets))
        task.mark_start()
        if released:
            self.start_append(
                entry_id=f"fresh-start-{os.urandom(6).hex()}",
                kind="fresh-start",
                window=first,
                resume_offsets=dict(floor, **task.offsets),
                note=f"started without a checkpoint in {where}; counting resumes {at}",
            )
            log.warning(
                "fresh start without a checkpoint in %s: numbering continues at window %d",
                where,
                first,
            )
        log.info("no checkpoint in %s: starting window %d at %s", where, first, at)
