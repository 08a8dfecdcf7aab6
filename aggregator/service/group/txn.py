"""A transactional producer that survives its fatal errors.

kafka-python's producer enters a fatal state when the broker fences it (``ProducerFencedError``:
a newer producer with the same transactional id, or a transaction the coordinator timed out and
aborted while the broker was away); every later call then raises. A member must not die of that
(the broker restarting mid-window is enough to cause it), so :class:`Transactions` aborts what it
can and, after a fatal error, closes the producer and makes a new one with the same id
(``init_transactions`` again: anything of the old one still open is aborted by the broker).

Every wait is bounded. kafka-python's ``send_offsets_to_transaction``, ``commit_transaction`` and
``abort_transaction`` wait for the coordinator's answer without a timeout, and a request lost
with a broker that was killed is never answered: a member was seen waiting in
``send_offsets_to_transaction`` for good after a kill -9 of the broker
(tests/integration/test_group_kafka.py). Here each wait gives up after :data:`TIMEOUT_S`; the
producer is then treated as broken (closed, made again).

Offsets never outlive their transaction. kafka-python (3.0.12) keeps the offsets of a
``send_offsets_to_transaction`` whose TxnOffsetCommit failed (``CommitFailedError`` after a
rebalance, common right after a broker restart) in the transaction manager and sends them again
with the *next* transaction's offsets, so an aborted close's offsets were committed by a later
close of another partition: a broker restart left a partition's offset one window ahead with no
summary of that window, and the leader waited for it for good. :meth:`Transactions.begin` drops
such leftovers (tests/integration/test_group_txn.py shows the leak on a real broker).
"""

from __future__ import annotations

import logging

from kafka.errors import (
    CommitFailedError,
    IllegalStateError,
    InvalidProducerEpochError,
    KafkaError,
    KafkaTimeoutError,
)

from consumers.kafka import compat

from .membership import fencing

__all__ = ["Transactions", "TIMEOUT_S", "drop_stale_offsets", "close_producer"]

log = logging.getLogger("panagg.group")

#: how long one transactional step may wait for the broker
TIMEOUT_S = 10.0


def _wait(producer, result, what: str) -> None:
    compat.wake_sender(producer)
    if not result.wait(timeout_ms=TIMEOUT_S * 1000):
        raise KafkaTimeoutError(f"{what} not answered within {TIMEOUT_S:g} s")


def drop_stale_offsets(producer) -> None:
    """Forget offsets a failed ``send_offsets_to_transaction`` left in ``producer`` (see the
    module docstring); call it before ``begin_transaction``."""
    compat.drop_stale_offsets(producer)


def close_producer(producer, timeout_s: float = 5.0) -> None:
    """Close ``producer`` for good, whatever the broker does. kafka-python's ``close`` raises
    when its flush times out (the broker away) before it stops the sender thread, which then
    lives on: it sent a dead producer's offsets once the broker was back, and the object's
    ``__del__`` printed a traceback later. Here the sender is stopped without sending."""
    try:
        producer.close(timeout=timeout_s)
        return
    except Exception:
        pass
    compat.force_close(producer, timeout_s)


class Transactions:
    """``make()`` returns a new transactional producer with ``init_transactions`` done.

    ``remake``: start over with a new producer after a fatal error (a member's intake and
    counting); False for a leader, which must give up leading instead (a newer leader fenced it).
    """

    def __init__(self, make, remake: bool = True):
        self._make, self._remake = make, remake
        self.producer = make()
        self._epoch = None  # the producer's id and epoch when the open transaction began

    def _id_and_epoch(self):
        tm = getattr(self.producer, "_transaction_manager", None)
        pe = getattr(tm, "producer_id_and_epoch", None)
        return None if pe is None else (pe.producer_id, pe.epoch)

    # -- one transaction's steps, each bounded ---------------------------------------------------
    def begin(self) -> None:
        drop_stale_offsets(self.producer)
        self.producer.begin_transaction()
        self._epoch = self._id_and_epoch()

    def send(self, *args, **kwargs):
        return self.producer.send(*args, **kwargs)

    def send_offsets(self, offsets, group_metadata) -> None:
        if not isinstance(group_metadata, str) and not fencing(group_metadata):
            # the broker would take these offsets from a member that fell out of its group
            # (membership.fencing): refuse here; the caller aborts and syncs again
            raise CommitFailedError("the consumer is between generations of its group")
        self._bounded(
            lambda tm: tm.send_offsets_to_transaction(offsets, group_metadata),
            lambda: self.producer.send_offsets_to_transaction(offsets, group_metadata),
            "the offsets of the transaction",
        )

    def commit(self) -> None:
        self._bounded(lambda tm: tm.begin_commit(), self.producer.commit_transaction, "the commit")

    def _abort(self) -> None:
        self._bounded(lambda tm: tm.begin_abort(), self.producer.abort_transaction, "the abort")

    def _bounded(self, start, unbounded, what: str) -> None:
        """Start a transactional request on the producer's transaction manager and wait for
        it at most TIMEOUT_S; a client without those internals gets its own (unbounded) call."""
        tm = getattr(self.producer, "_transaction_manager", None)
        if tm is None or not hasattr(self.producer, "_sender"):
            unbounded()
            return
        _wait(self.producer, start(tm), what)

    def cause(self, exc: Exception) -> Exception:
        """The error behind ``exc``: a producer fenced in the middle of a transaction answers
        every later transactional call with a generic ``KafkaError`` ("... in an error state:
        ProducerFencedError"); the error that put it there says what happened (another member
        took the transactional id), so the caller can tell a race from a broken cluster.

        A producer that met ``InvalidProducerEpochError`` bumps its epoch on its own, which
        ends the open transaction; the next send or commit then raises ``IllegalStateError``
        ("Cannot call send in state ...") or a generic ``KafkaError`` (an invalid transition)
        with no error recorded. If the producer's epoch moved or is moving since :meth:`begin`,
        that is the cause (a member of two started together exited with ``IllegalStateError``
        in the suite, issue 46)."""
        if type(exc) not in (KafkaError, IllegalStateError):
            return exc
        tm = getattr(self.producer, "_transaction_manager", None)
        if tm is None:
            return exc
        last = getattr(tm, "last_error", None)
        if isinstance(last, KafkaError):
            return last
        bumping = getattr(tm, "is_bumping_epoch", lambda: False)()
        if bumping or (self._epoch is not None and self._id_and_epoch() != self._epoch):
            return InvalidProducerEpochError(
                f"the producer's epoch moved during the transaction ({exc})"
            )
        return exc

    def failed(self, exc: Exception) -> None:
        """Clean up after ``exc`` broke the open transaction: abort it, or start over with a
        new producer when the old one cannot abort (fatal). Never raises."""
        tm = getattr(self.producer, "_transaction_manager", None)
        fatal = tm is None or tm.has_fatal_error() or isinstance(exc, KafkaTimeoutError)
        if not fatal:
            try:
                self._abort()
                return
            except Exception:
                fatal = True
        if not self._remake:
            return
        log.info(
            "transactional producer %s starts over after %s",
            getattr(self.producer, "config", {}).get("transactional_id", ""),
            type(exc).__name__,
        )
        close_producer(self.producer)
        try:
            self.producer = self._make()
        except Exception as again:  # the broker is still away: try again at the next failure
            log.warning("cannot start a new transactional producer yet (%s)", type(again).__name__)

    def close(self) -> None:
        close_producer(self.producer)
