"""The one small interface every event source implements.

A source hands out :class:`Segment` s: consecutive records of one partition (a Kafka partition, a
file, the generator), each with its offset and raw value bytes. The service decodes values, counts
items, and stores ``next offset`` per partition inside its checkpoint; on restart it calls
:meth:`Source.seek` with those offsets, which is what makes counting exactly-once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Segment", "Source", "offsets_array", "take_items"]


@dataclass
class Segment:
    """Records of one partition. ``offsets``, ``keys`` and ``headers`` are sequences (indexing,
    slicing, ``len``), not necessarily lists: the Kafka source gives a ``range`` for consecutive
    offsets and reads keys and headers from its records only where they are used."""

    partition: str  # stable key, e.g. "logins:3", "file:events.jsonl", "generator"
    offsets: Sequence[int]  # offset of each record, increasing
    values: list[bytes]  # raw message values, same length as offsets
    keys: Sequence | None = None  # record keys where the source has them (Kafka), else None
    headers: Sequence | None = None  # record headers, [(name, bytes), ...] each (Kafka), else None
    #: record timestamps in ms since the epoch (Kafka; -1 or None: the record has none), else
    #: None (the source carries no timestamps: event-time windows reject every record)
    timestamps: Sequence | None = None

    def __len__(self) -> int:
        return len(self.values)


def offsets_array(offsets: Sequence[int]) -> np.ndarray:
    """A segment's offsets as int64 (a ``range`` without a Python int per record)."""
    if isinstance(offsets, range):
        return np.arange(offsets.start, offsets.stop, offsets.step, dtype=np.int64)
    return np.asarray(offsets, dtype=np.int64)


def take_items(items, idx: np.ndarray):
    """Decoded ``items`` at the positions ``idx`` (an int64 array on the fast path, else a
    list)."""
    if isinstance(items, np.ndarray):
        return items[idx]
    return [items[int(i)] for i in idx]


class Source:
    """Base class: override ``poll``; the rest have safe defaults."""

    #: True once a finite source has delivered everything (files, the generator).
    exhausted: bool = False

    def seek(self, offsets: dict[str, int]) -> None:
        """Resume each partition at the given next offset (from a checkpoint)."""

    def poll(self, timeout_s: float = 1.0) -> list[Segment]:
        raise NotImplementedError

    def commit(self, offsets: dict[str, int], metadata: str = "") -> None:
        """Report progress upstream (Kafka: group offsets, for lag monitoring only, with
        ``metadata``: the ledger's anchor)."""

    def lag(self, positions: dict[str, int] | None = None) -> dict[str, int] | None:
        """Records behind the end of each partition, where the source knows it (``positions``:
        the service's next offset per partition)."""
        return None

    def close(self) -> None:
        """Release resources."""
