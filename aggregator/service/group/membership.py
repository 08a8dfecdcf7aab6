"""What a counting stage holds of its consumer group: its partitions, the generation it was
given them in, and whether it leads (the ledger topic's one partition rides along).

Both counting stages (:mod:`.counter`, the items exchange, and :mod:`.views`) sync with it after
a rebalance and check it before every close: kafka-python rejoins in its background thread, so
a rebalance can move a partition between a poll and a window's close. Each commit names the
generation of the sync (a commit after an unsynced rebalance is refused by the coordinator), and
a close first checks that the generation and the partitions are still its own (the README's
start loop once produced two committed views of one partition's window without it).
"""

from __future__ import annotations

from kafka import ConsumerRebalanceListener
from kafka.structs import MemberState

__all__ = ["Membership", "fencing"]


def fencing(meta) -> bool:
    """Whether a transaction's offsets committed under group metadata ``meta`` are fenced.

    A consumer that fell out of its group (a heartbeat refused after a broker restart, a session
    timeout) has generation -1 and no member id until it joins again, and keeps its assignment
    meanwhile. The broker accepts a TxnOffsetCommit with generation -1 and no member id from
    anyone (old clients sent no group metadata), so a close in that gap would commit a window
    of partitions another member already counts: two views of one window (seen under load with
    two members started together). Only a generation and a member id let the broker refuse it.
    """
    return getattr(meta, "generation_id", -1) >= 0 and bool(getattr(meta, "member_id", ""))


class Membership:
    """The assignment of ``consumer`` as of its last :meth:`sync`, over ``counted`` (the topic
    the stage counts) and ``ledger`` (the leader's topic)."""

    def __init__(self, consumer, counted: str, ledger: str):
        self.consumer, self.counted, self.ledger = consumer, counted, ledger
        #: the group metadata at the last sync (passed to send_offsets_to_transaction)
        self.generation = None
        self.is_leader = False

    def subscribe(self, stage, on_revoked=None) -> None:
        """Subscribe to the counted topic and the ledger's (whoever the group gives the ledger's
        one partition leads; it is paused at once, the ledger is read by its own consumer).
        A rebalance marks ``stage._needs_sync``, and a lost ledger partition ``stage.is_leader``
        False; ``on_revoked(partition)`` for each counted partition taken away."""

        counted, ledger = self.counted, self.ledger

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked):
                for tp in revoked:
                    if tp.topic == ledger:
                        stage.is_leader = False
                    elif tp.topic == counted and on_revoked is not None:
                        on_revoked(tp.partition)
                stage._needs_sync = True

            def on_partitions_assigned(self, assigned):
                stage._needs_sync = True

        self.consumer.subscribe([counted, ledger], listener=_Listener())

    def sync(self) -> set[int] | None:
        """Read the assignment now: pause the ledger's partition (it is read by its own
        consumer), note whether this member leads; returns the counted partitions owned, or
        None while the member is between generations (try again after the next poll)."""
        meta = self.consumer.group_metadata()
        if not fencing(meta) or meta.state != MemberState.STABLE:
            return None
        assigned = self.consumer.assignment()
        self.generation = meta
        ledger_tps = [tp for tp in assigned if tp.topic == self.ledger]
        if ledger_tps:
            self.consumer.pause(*ledger_tps)
        self.is_leader = bool(ledger_tps)
        return {tp.partition for tp in assigned if tp.topic == self.counted}

    def holds(self, partitions) -> bool:
        """Whether ``partitions`` of the counted topic are still this member's, in the
        generation of the last sync."""
        return self.why_not(partitions) is None

    def why_not(self, partitions) -> str | None:
        """Why ``partitions`` are not (any more) this member's in the generation of the last
        sync, in words for the log; None when they are."""
        if self.generation is None:
            return "not synced with the group yet"
        now = self.consumer.group_metadata()
        if not fencing(now):
            return f"this member fell out of the group ({getattr(now, 'state', '?')})"
        if now.generation_id != self.generation.generation_id:
            return (
                f"the group moved from generation {self.generation.generation_id} to "
                f"{now.generation_id} ({getattr(now, 'state', '?')})"
            )
        owned = {tp.partition for tp in self.consumer.assignment() if tp.topic == self.counted}
        lost = sorted(set(partitions) - owned)
        if lost:
            return f"partition(s) {', '.join(map(str, lost))} no longer assigned here"
        return None
