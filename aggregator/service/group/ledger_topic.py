"""The privacy ledger of a scale-out group, kept in a single-partition Kafka topic.

The same hash-chained entries and budget rules as the one-process ledger file
(:class:`~aggregator.service.ledger.Ledger`), with the topic as the only copy:

* **One writer.** Only the group's leader appends (the member the group assigns the ledger's one
  partition), through a transactional producer whose id is fixed per group: a new leader's
  ``init_transactions`` fences the old one, so a leader the group has dropped cannot append.
* **One order.** One partition is one log; every reader sees the entries in the writer's order,
  and the chain (``seq``, ``prev``, ``hash``) is checked on every read. A gap or an edit stops the
  reader with one line, as for the file.
* **Nothing removed.** The topic is compacted and every entry has its own key (its ``seq``), so
  compaction never drops one; a delete-policy topic is refused at start
  (:mod:`aggregator.service.group.topics`).
* **Read committed.** Readers see an entry only once its transaction committed, i.e. together
  with the release document and the offsets it was written with.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from kafka import TopicPartition
from kafka.errors import KafkaTimeoutError

from ..ledger import GENESIS, Ledger, LedgerError
from .topics import read_partition

__all__ = ["TopicLedger", "LedgerUnreachable"]


class LedgerUnreachable(LedgerError, KafkaTimeoutError):
    """The ledger topic could not be read to its end in time (the broker away or restarting).
    A Kafka error too: a member's loop treats it as an outage and retries the stage, where a
    damaged ledger (a plain :class:`LedgerError`) stops the member."""

    def __str__(self) -> str:  # the message alone, without KafkaError's class-name prefix
        return RuntimeError.__str__(self)


class TopicLedger(Ledger):
    """The ledger in topic ``topic`` (partition 0), read with ``consumer`` (a kafka-python
    ``KafkaConsumer`` with ``isolation_level="read_committed"`` and no group; this object assigns
    it). Budgets as for :class:`~aggregator.service.ledger.Ledger`."""

    def __init__(
        self,
        consumer,
        topic: str,
        *,
        budget_per_window: float,
        budget_total: float | None = None,
        budget_per_event: float | None = None,
    ):
        self.topic = topic
        self._tp = TopicPartition(topic, 0)
        self._consumer = consumer
        consumer.assign([self._tp])
        consumer.seek_to_beginning(self._tp)
        #: shown where the file ledger shows its path
        self.path = Path(f"kafka-topic:{topic}")
        self.budget_per_window = float(budget_per_window)
        self.budget_total = None if not budget_total else float(budget_total)
        self.budget_per_event = float(budget_per_event or budget_per_window)
        self.torn_tail = False
        self.entries: list[dict] = []
        self._by_id: dict[str, dict] = {}
        #: entries appended in the open transaction, not yet committed
        self._pending: list[dict] = []

    def reload(self) -> None:  # the topic is tailed, never re-read from a path
        pass

    def anchor_problem(self, anchor: dict | None) -> str | None:
        """Why this topic cannot be the ledger ``anchor`` (a head the counting group's committed
        offsets recorded) was taken from; None if it holds that entry."""
        if not anchor or int(anchor.get("seq", 0)) <= 0:
            return None
        seq, want = int(anchor["seq"]), str(anchor.get("hash", ""))
        if seq > len(self.entries):
            return (
                f"the ledger topic {self.topic} ends at entry {len(self.entries)}, but the "
                f"group's committed offsets record entry {seq}: it was deleted, truncated "
                "or replaced"
            )
        if not self.entries[seq - 1]["hash"].startswith(want):
            return (
                f"the ledger topic {self.topic} differs at entry {seq} from the one the "
                "group's committed offsets record: it was replaced"
            )
        return None

    # -- reading ---------------------------------------------------------------------------------
    def tail(self, timeout_s: float = 0.0) -> list[dict]:
        """Read what was committed since the last call; the new entries (chain checked)."""
        new = []
        polled = self._consumer.poll(timeout_ms=int(timeout_s * 1000))
        for records in polled.values():
            for rec in records:
                new.append(self._take(rec.value, rec.offset))
        return new

    def read_to_end(self, timeout_s: float = 30.0) -> None:
        """Read every committed entry there is now (a new leader does this before it writes)."""
        if not read_partition(
            self._consumer, self._tp, lambda r: self._take(r.value, r.offset), timeout_s
        ):
            raise LedgerUnreachable(
                f"ledger topic {self.topic}: could not read to its end "
                f"within {timeout_s:g} s; check the broker"
            )

    def _take(self, raw: bytes, offset: int) -> dict:
        where = f"ledger topic {self.topic} offset {offset}"
        try:
            entry = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError):
            raise LedgerError(
                f"{where} is not a JSON entry; the ledger is the record of "
                "privacy spent: it cannot be read past this point"
            ) from None
        problem = self._problem(entry)
        if problem is None:
            head = self.head()
            problem = self._chain_problem(entry, head["seq"] + 1, head["hash"])
        if problem:
            raise LedgerError(
                f"{where} {problem}; the ledger is the record of privacy spent "
                "(a second writer, or the topic was edited): stop every member "
                "and restore the topic"
            )
        self.entries.append(entry)
        self._by_id[entry["id"]] = entry
        return entry

    # -- writing (the leader, inside its transaction) ------------------------------------------
    def head(self) -> dict:
        chain = self.entries + self._pending
        if not chain:
            return {"seq": 0, "hash": GENESIS}
        return {"seq": chain[-1]["seq"], "hash": chain[-1]["hash"]}

    def append(
        self,
        *,
        entry_id: str,
        kind: str,
        window=None,
        epsilon_spent: float = 0.0,
        model: str = "",
        note: str = "",
        producer=None,
        **extra,
    ) -> bool:
        """Send the entry with ``producer`` (in its open transaction). It counts as written
        only after :meth:`committed`; :meth:`aborted` forgets it."""
        if entry_id in self._by_id or any(e["id"] == entry_id for e in self._pending):
            return False
        if producer is None:
            raise LedgerError("the group ledger is written by the leader's transaction only")
        entry = self.chained_entry(
            entry_id=entry_id,
            kind=kind,
            window=window,
            epsilon_spent=epsilon_spent,
            model=model,
            note=note,
            **extra,
        )
        producer.send(
            self.topic,
            partition=0,
            key=f"{entry['seq']:012d}".encode(),
            value=json.dumps(entry, sort_keys=True, allow_nan=False).encode(),
        )
        self._pending.append(entry)
        return True

    def committed(self, timeout_s: float = 30.0) -> None:
        """The transaction with the pending entries committed: read them back from the topic
        (so the copy in memory is always what the topic holds, chain checked). The commit can
        return before its marker moves the topic's last stable offset, so the read goes on
        until they are in: an append computed from a copy without them would reuse their seq
        and fork the chain (seen once: "offset 8 has seq 4 where 5 belongs")."""
        want = self._pending[-1]["seq"] if self._pending else None
        self._pending = []
        deadline = time.monotonic() + timeout_s
        self.read_to_end(timeout_s)
        while want is not None and self.head()["seq"] < want:
            if time.monotonic() > deadline:
                raise LedgerUnreachable(
                    f"ledger topic {self.topic}: entry {want} was committed "
                    f"but could not be read back within {timeout_s:g} s; "
                    "check the broker"
                )
            time.sleep(0.02)
            self.read_to_end(timeout_s)

    def aborted(self) -> None:
        self._pending = []
