"""A transactional producer that survives its fatal errors.

kafka-python's producer enters a fatal state when the broker fences it (``ProducerFencedError``:
a newer producer with the same transactional id, or a transaction the coordinator timed out and
aborted while the broker was away); every later call then raises. A member must not die of that
(the broker restarting mid-window is enough to cause it), so :class:`Transactions` aborts what it
can and, after a fatal error, closes the producer and makes a new one with the same id
(``init_transactions`` again: anything of the old one still open is aborted by the broker).
"""

from __future__ import annotations

import logging

__all__ = ["Transactions"]

log = logging.getLogger("panagg.group")


class Transactions:
    """``make()`` returns a new transactional producer with ``init_transactions`` done."""

    def __init__(self, make):
        self._make = make
        self.producer = make()

    def failed(self, exc: Exception) -> None:
        """Clean up after ``exc`` broke the open transaction: abort it, or start over with a
        new producer when the old one cannot abort (fatal). Never raises."""
        tm = getattr(self.producer, "_transaction_manager", None)
        fatal = tm is None or tm.has_fatal_error()
        if not fatal:
            try:
                self.producer.abort_transaction()
                return
            except Exception:
                fatal = True
        log.info("transactional producer %s starts over after %s",
                 getattr(self.producer.config, "get", lambda k: "")("transactional_id")
                 if hasattr(self.producer, "config") else "", type(exc).__name__)
        try:
            self.producer.close(timeout=5)
        except Exception:
            pass
        try:
            self.producer = self._make()
        except Exception as again:  # the broker is still away: try again at the next failure
            log.warning("cannot start a new transactional producer yet (%s)",
                        type(again).__name__)

    def close(self) -> None:
        try:
            self.producer.close(timeout=5)
        except Exception:
            pass
