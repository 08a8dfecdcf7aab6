"""The service's one Kafka producer, made on first use and flushed at the stop.

Dead letters (``source.dead_letter_topic``) and releases (``release.topic``) are written with
one producer per aggregation (:func:`..deadletter.service_producer`: every write acknowledged by
all in-sync replicas). A service that writes neither never connects one: the producer is made
the first time a stage asks for it. At the stop what it still buffers is flushed (at most 5 s)
and it is closed; a broker that is gone by then is not an error of the stop (each checkpoint
waits for the dead letters before it, :mod:`.checkpoint`, and a release leaves the checkpoint's
pending list only once the topic holds it, :mod:`.publish`).

Durable writes: none of its own (the records of its callers).
"""

from __future__ import annotations

from ..deadletter import service_producer
from ..settings import Config

__all__ = ["SharedProducer"]


class SharedProducer:
    """The producer of one aggregation; :meth:`get` is the ``producer`` callable of the stages
    that write to Kafka."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.producer = None

    def get(self):
        """The producer (made now if it is not yet)."""
        if self.producer is None:
            self.producer = service_producer(self.cfg)
        return self.producer

    def close(self) -> None:
        """Flush and close the producer, if one was made."""
        if self.producer is not None:
            try:
                self.producer.flush(timeout=5)
                self.producer.close(timeout=5)
            except Exception:
                pass
            self.producer = None
