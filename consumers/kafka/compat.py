"""kafka-python's private parts the project touches, in one place, checked when a client is made.

Three kafka-python bugs (3.0.12) make the service inexact or stall it unless it reaches inside
the client, and two waits of the transactional producer are unbounded unless it does:

* **a drained slot keeps paused records parked** (:func:`unpark`): records fetched for a
  partition while it was paused are parked and given back only when the fetcher's in-line slot
  is ``None``; a drained (empty) slot left there keeps them parked for good and the partition
  is never read again. Reproducer and report: docs/upstream/kafka-python-parked-records.md.
* **a join left half done never completes** (:func:`finish_join`): a rejoin the leader starts
  because the topic's metadata changed (every new group whose first join came before the topic's
  metadata) stops counting as needed once the leader has computed the new assignment, before the
  SyncGroup answer; a ``poll`` whose timeout ends in between leaves the join task in flight, and
  no later ``poll`` awaits it: the consumer stays with no partition and its heartbeat off, for
  good. Reproducer and report: docs/upstream/kafka-python-stuck-join.md.
* **pending transactional offsets are re-sent** (:func:`drop_stale_offsets`): the offsets of a
  ``send_offsets_to_transaction`` whose TxnOffsetCommit failed stay in the transaction manager
  and go out with the next transaction's. Report: docs/upstream/kafka-python-txn-offsets.md.
* the producer's sender is woken by hand for a bounded wait (:func:`wake_sender`), and stopped
  without a flush when the broker is away (:func:`force_close`).

Each of these is a private attribute: a kafka-python release that renames one would turn the
fix into a silent no-op. So every client the service makes is checked here first
(:func:`check_consumer`, :func:`check_producer`): a missing attribute stops the start with one
line naming the installed version and the tested one (:data:`TESTED`), and ``pyproject.toml``
pins the tested minor.
"""

from __future__ import annotations

from importlib.metadata import version

__all__ = [
    "TESTED",
    "KafkaPythonIncompatible",
    "check_consumer",
    "check_producer",
    "unpark",
    "finish_join",
    "drop_stale_offsets",
    "wake_sender",
    "force_close",
]

#: the kafka-python minor these patches were written and tested against
TESTED = "3.0"

#: object path (attribute chain from the client) -> what the service needs it for
_CONSUMER = {
    ("_fetcher", "_next_partition_records"): "resume parked records",
    ("_fetcher", "_paused_partition_records"): "resume parked records",
    ("_client", "cluster"): "broker connection state",
    ("_coordinator", "_join_task"): "finishing a join a poll left half done",
    ("_coordinator", "need_rejoin"): "finishing a join a poll left half done",
    ("_coordinator", "request_rejoin"): "finishing a join a poll left half done",
}
_PRODUCER = {
    ("_sender", "wakeup"): "bounded transactional waits",
    ("_sender", "force_close"): "closing with the broker away",
    ("_closed",): "closing with the broker away",
}
_TRANSACTIONAL = {
    (
        "_transaction_manager",
        "_pending_txn_offset_commits",
    ): "dropping a failed transaction's offsets",
    ("_transaction_manager", "_lock"): "dropping a failed transaction's offsets",
}


class KafkaPythonIncompatible(RuntimeError):
    """The installed kafka-python lacks a private attribute the service relies on."""


def _version() -> str:
    try:
        return version("kafka-python")
    except Exception:
        return "unknown"


def _missing(obj, needs: dict) -> list[str]:
    out = []
    for chain, why in needs.items():
        cur = obj
        for name in chain:
            if not hasattr(cur, name):
                out.append(f"{'.'.join(chain)} ({why})")
                break
            cur = getattr(cur, name)
    return out


def _check(obj, needs: dict) -> None:
    missing = _missing(obj, needs)
    if missing:
        raise KafkaPythonIncompatible(
            f"kafka-python {_version()} lacks {', '.join(missing)}, which panagg needs (tested "
            f"with kafka-python {TESTED}.x); install that minor: pip install "
            f"'kafka-python>={TESTED},<{TESTED.split('.')[0]}.{int(TESTED.split('.')[1]) + 1}'"
        )


def check_consumer(consumer) -> None:
    """Raise :class:`KafkaPythonIncompatible` (one line) if ``consumer`` lacks a patched part."""
    _check(consumer, _CONSUMER)


def check_producer(producer, transactional: bool = False) -> None:
    """The same for a producer (``transactional``: its transaction manager's parts too)."""
    _check(producer, {**_PRODUCER, **(_TRANSACTIONAL if transactional else {})})


def unpark(consumer) -> None:
    """Let a resumed partition's parked records back in: clear a drained (empty) in-line slot
    while records are parked, which is what the fetcher means by ``None`` there. The service
    holds and resumes partitions to replay windows exactly; without this, 8 of 12 random
    pause/seek/resume runs left a partition unread for good
    (tests/integration/test_faults_kafka.py)."""
    fetcher = consumer._fetcher
    slot = fetcher._next_partition_records
    if slot is not None and not slot and fetcher._paused_partition_records:
        fetcher._next_partition_records = None


def finish_join(consumer) -> None:
    """Call before each ``poll`` of a subscribed consumer: if a join task is in flight (or done
    and never read) while the coordinator no longer asks for a rejoin, ask again, so that the
    next ``poll`` awaits that task (its assignment is applied and the heartbeat turned back on)
    or, if it already ended, joins once more. Without it a consumer polled with a short timeout
    kept no partition for good in 10 of 10 new groups (1 ms polls) and in 2 of 40 with 200 ms
    polls on a loaded machine (docs/upstream/kafka-python-stuck-join.md)."""
    coordinator = consumer._coordinator
    if coordinator._join_task is not None and not coordinator.need_rejoin():
        coordinator.request_rejoin()


def drop_stale_offsets(producer) -> None:
    """Forget offsets a failed ``send_offsets_to_transaction`` left in ``producer``; call it
    before ``begin_transaction`` (tests/integration/test_group_txn.py shows the leak)."""
    tm = producer._transaction_manager
    stale = tm._pending_txn_offset_commits if tm is not None else None
    if stale:
        with tm._lock:
            stale.clear()


def wake_sender(producer) -> None:
    """Make the sender thread send what a transactional call just queued, now."""
    producer._sender.wakeup()


def force_close(producer, timeout_s: float) -> None:
    """Stop ``producer``'s sender thread without sending anything and mark it closed (its
    ``__del__`` then does nothing): what ``close`` cannot do when its flush times out."""
    sender = producer._sender
    if sender is not None:
        sender.force_close()
        sender.join(timeout_s)
    producer._closed = True
