"""A stop never hangs on librdkafka's close (consumers/kafka/confluent.py, ConfluentSource.close).

The chaos matrix saw it once (time_confluent, a clean broker restart): the group coordinator
stopped answering, ``Consumer.close()`` waited on it past the harness's 120 s, and SIGTERM did
not stop the service (librdkafka#3740 describes the same wait). No broker can be made to do that
on demand, so the client here is a stand-in whose close blocks until released; what is tested is
the bound and the line the operator gets, not librdkafka.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

pytest.importorskip("confluent_kafka")

from consumers.kafka import confluent  # noqa: E402


class StuckConsumer:
    """A consumer whose close waits until ``release`` is set (a coordinator that never answers)."""

    def __init__(self):
        self.release = threading.Event()
        self.closed = False

    def close(self):
        self.release.wait()
        self.closed = True


def test_close_returns_within_its_bound_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(confluent, "_CLOSE_S", 0.5)
    src = object.__new__(confluent.ConfluentSource)
    src.consumer, src.group = StuckConsumer(), "g-stuck"
    threading.Timer(10.0, src.consumer.release.set).start()  # (an unbounded close ends too)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="panagg.kafka"):
        src.close()
    assert time.monotonic() - t0 < 5.0
    (line,) = [r.getMessage() for r in caplog.records]
    assert "did not leave group 'g-stuck'" in line and "stopping without it" in line
    src.consumer.release.set()


def test_a_close_that_answers_is_waited_for_and_says_nothing(monkeypatch, caplog):
    monkeypatch.setattr(confluent, "_CLOSE_S", 5.0)
    src = object.__new__(confluent.ConfluentSource)
    src.consumer, src.group = StuckConsumer(), "g-ok"
    threading.Timer(0.2, src.consumer.release.set).start()
    with caplog.at_level(logging.WARNING, logger="panagg.kafka"):
        src.close()
    assert src.consumer.closed and not caplog.records
