"""A source that hands out fixed segments of one partition, running a hook between two of them:
the instant an intruder looks in the privacy audits (tests/test_privacy_service.py,
tests/user_audit.py), after the previous batch was counted and checkpointed."""

from __future__ import annotations

from consumers.base import Segment, Source


class ScriptedSource(Source):
    """``segments`` (lists of record values) of ``partition``; ``at[k]()`` runs before segment
    k is handed out."""

    def __init__(self, segments, at, partition: str = "audit:0"):
        self.segments, self.at, self.partition = segments, at, partition
        self.k, self.offset = 0, 0

    def poll(self, timeout_s=1.0):
        if self.k in self.at:
            self.at[self.k]()
        if self.k >= len(self.segments):
            self.exhausted = True
            return []
        values = self.segments[self.k]
        self.k += 1
        offsets = list(range(self.offset, self.offset + len(values)))
        self.offset += len(values)
        return [Segment(self.partition, offsets, values)]
