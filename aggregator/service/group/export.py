"""Audit exports of a Kafka-only group: the slices of every partition made one signed export.

``panagg audit export`` on a member's directory asks the aggregation's leader (forced.py, the
same path as a forced release). The leader writes close markers carrying the export's id; each
counting partition, at its marker, exports its open window's slice the way one process exports
its state (docs/privacy.md section 6: a fresh layer, the snapshot, another fresh layer) and closes
that window at once, the slice written in the same transaction as the window's summary and its
committed offset. So no crash can replay a window whose slice was exported (a replay would be a
second view of its events under fresh noise), and a slice that was not committed was never seen.

The leader collects the P slices of the export (``<group>.panagg.exports``, key
``slice/<id>/<p>``), puts them together into one state of the group's D counters (counter i is
slice i mod P's counter i div P, as the intake split them), signs it with the audit key
(``audit.key_file`` or ``PANAGG_AUDIT_KEY``, as one process) and, in one transaction, appends a
ledger entry (``kind = export``, epsilon 0) and writes the signed document (key ``doc/<id>``)
and tombstones for the slices; then it writes the file into ``audit.dir`` too. The windows the
export closed are released as any window; the partitions that exported hold two more layers, so
the merge gives the other partitions fresh layers up to the same count (summary.py).
"""

from __future__ import annotations

import logging

import msgpack
import numpy as np
from kafka import TopicPartition

from ...state import PanPrivateHistogram

__all__ = ["assemble", "ExportCollector"]

log = logging.getLogger("panagg.group")


def assemble(slices: list[dict]) -> PanPrivateHistogram:
    """One state of all partitions' counters from their exported slices (``slices[p]`` the
    message of partition p). Layers: the most any slice holds (the others get fresh layers up to
    it, which keeps one noise model for the whole state)."""
    P = len(slices)
    states = [PanPrivateHistogram.deserialize(s["state"]) for s in slices]
    layers = max(st.layers for st in states)
    for st in states:
        while st.layers < layers:
            st.rerandomize()
    D = sum(st.size for st in states)
    counts = np.zeros(D, dtype=np.int64)
    for p, st in enumerate(states):
        counts[p::P] = st.counts
    whole = PanPrivateHistogram.deserialize(states[0].serialize())
    whole._counts = counts
    whole._layers = layers
    if whole._n is not None:
        whole._n = int(sum(st.n for st in states))
    return whole


class ExportCollector:
    """The leader's reading of ``<group>.panagg.exports``: slices by export id."""

    def __init__(self, consumer, topics, partitions: int):
        self.consumer, self.topics, self.P = consumer, topics, int(partitions)
        tp = TopicPartition(topics.exports, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        self.slices: dict[str, dict[int, dict]] = {}
        self.done: set[str] = set()

    def poll(self) -> None:
        for records in self.consumer.poll(timeout_ms=0).values():
            for rec in records:
                key = (rec.key or b"").decode()
                kind, _, rest = key.partition("/")
                if kind == "doc":
                    self.done.add(rest)
                    self.slices.pop(rest, None)
                elif kind == "slice" and rec.value is not None:
                    eid, _, p = rest.rpartition("/")
                    if eid not in self.done:
                        self.slices.setdefault(eid, {})[int(p)] = msgpack.unpackb(
                            rec.value, raw=False
                        )

    def complete(self) -> list[tuple[str, list[dict]]]:
        """Exports whose P slices are all in, each with its slices in partition order."""
        self.poll()
        return [
            (eid, [have[p] for p in range(self.P)])
            for eid, have in self.slices.items()
            if len(have) == self.P
        ]
