"""Layered snapshots of a group member's open windows (``checkpoint.snapshots_per_window``).

Without snapshots a partition's open window lives only in its member's memory and a crash
replays it from its start (docs/privacy.md section 16). A long window (a day-long rollup level)
then replays a day. With k snapshots per window, partition p takes snapshot j once it has counted
a record stamped at j / (k + 1) of the window (the intake's stamps: public): a fresh layer, the
snapshot, another fresh layer (docs/privacy.md section 6), and, in one Kafka transaction, the
snapshot to ``<group>.panagg.snapshots`` (partition p, key p) and the partition's committed offset
at the snapshot's position with metadata ``{"w": window, "s": j, "st": window start}``. A new
owner finds ``s`` in the metadata and resumes the window from that snapshot at that offset, so
a crash replays at most 1 / (k + 1) of a window and never draws the window's noise again (a
replay from the start under fresh noise would be a second view of what the snapshot holds).

A snapshot that cannot be found or does not match the metadata (the topic was deleted or
truncated) is never worked around by a replay from the start: the window is counted on from the
committed offset and, at its close, withheld (its positions charged, nothing published), with
one ERROR line. The window's close tombstones its snapshot in the same transaction.

The views exchange (``views.ViewCounter``) takes the same layered look of a member's one window
state over its source partitions, at j / (k + 1) of the window by the member's clock
(:func:`view_snapshot`, key: the window's lowest partition), with every covered partition's
offset committed at once; a new owner of all of them resumes it (:func:`view_resume`). Both
restores add a fresh layer before counting on, as one process's does (window.py).
"""

from __future__ import annotations

import logging

import msgpack
from kafka import TopicPartition

from ...state import PanPrivateHistogram
from .topics import read_partition

__all__ = [
    "layered_look",
    "take_snapshot",
    "restore",
    "read_snapshot",
    "view_snapshot",
    "view_resume",
]

log = logging.getLogger("panagg.group")


def layered_look(state) -> bytes:
    """docs/privacy.md section 6's announced look: a fresh layer, the snapshot, another fresh
    layer (``state`` keeps both layers). Snapshots and audit exports of a slice both take it."""
    state.rerandomize()
    blob = state.serialize()
    state.rerandomize()
    return blob


def take_snapshot(task) -> bytes:
    """The open window's layered snapshot message (the task's state gets its two layers)."""
    blob = layered_look(task.state)
    task.snapshots += 1
    return msgpack.packb(
        {
            "window": task.window,
            "seq": task.snapshots,
            "start": task.start,
            "position": task.position,
            "events": task.events,
            "state": blob,
        },
        use_bin_type=True,
    )


def read_snapshot(reader, partition: int) -> dict | None:
    """The latest snapshot in partition ``partition`` of the snapshots topic under key
    ``partition``, decoded (None: none there, deleted, truncated or tombstoned)."""
    if reader is None:
        return None

    tp = TopicPartition(reader.topic, partition)
    reader.consumer.assign([tp])
    reader.consumer.seek_to_beginning(tp)
    latest = {}

    def take(rec):
        if rec.key == str(partition).encode():
            latest["value"] = rec.value

    read_partition(reader.consumer, tp, take)
    if latest.get("value") is None:
        return None
    return msgpack.unpackb(latest["value"], raw=False)


def restore(task, meta: dict, reader, partition: int) -> None:
    """Resume ``task`` (placed at the committed offset) from the snapshot the metadata names;
    mark it lost when there is none to match."""
    want = (int(meta["w"]), int(meta["s"]))
    task.start = int(meta.get("st", task.start))
    found = read_snapshot(reader, partition)
    if (
        found is None
        or (int(found["window"]), int(found["seq"])) != want
        or int(found["position"]) != task.position
    ):
        task.lost = (
            f"its layered snapshot {want[1]} of window {want[0]} is missing from "
            f"{getattr(reader, 'topic', 'the snapshots topic')} (deleted or "
            "truncated): the window is withheld, never replayed under fresh noise"
        )
        log.error("partition %d: %s", partition, task.lost)
        return
    task.state = PanPrivateHistogram.deserialize(found["state"])
    # one process's restore rule (window.py): a fresh layer before counting on, so the memory
    # after the resume is never the snapshot plus the exact increments since
    task.state.rerandomize()
    task.snapshots = int(found["seq"])
    task.events = int(found["events"])
    log.info(
        "partition %d resumes window %d from its snapshot %d at offset %d",
        partition,
        want[0],
        want[1],
        task.position,
    )


# -- the views exchange: one snapshot of a member's window over its source partitions ----------
def view_snapshot(task) -> bytes:
    """The layered snapshot of a views member's open window (``views.MemberWindow``): the state
    (its n is public under replace-one, section 10) and the source ranges it holds, nothing
    else; the task's state gets its two layers."""
    blob = layered_look(task.state)
    task.snapshots += 1
    return msgpack.packb(
        {
            "window": task.window,
            "seq": task.snapshots,
            "ranges": {str(p): list(r) for p, r in sorted(task.ranges.items())},
            "state": blob,
        },
        use_bin_type=True,
    )


def view_resume(reader, anchor: int, want: tuple[int, int], at: dict[int, int]):
    """The state and window-start offsets of snapshot ``want`` = (window, seq) that partition
    ``anchor``'s key holds, when it covers exactly the partitions of ``at`` at those committed
    offsets; else a string saying why it cannot be resumed. The state gets one fresh layer, as
    one process's restore adds (window.py): the memory after the resume is never the snapshot
    plus exact increments."""
    found = read_snapshot(reader, anchor)
    if (
        found is None
        or (int(found["window"]), int(found["seq"])) != want
        or {int(p): int(r[1]) for p, r in found["ranges"].items()} != at
    ):
        return (
            f"its layered snapshot {want[1]} of window {want[0]} is missing from "
            f"{getattr(reader, 'topic', 'the snapshots topic')} (deleted or truncated)"
        )
    state = PanPrivateHistogram.deserialize(found["state"])
    state.rerandomize()
    return state, {int(p): int(r[0]) for p, r in found["ranges"].items()}
