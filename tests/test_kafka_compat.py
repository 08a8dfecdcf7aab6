"""kafka-python's private parts the service patches (consumers/kafka/compat.py) are checked on
every client it makes: a release that renamed one stops the start with one line naming the
installed and the tested version, instead of turning the fix into a silent no-op."""

from __future__ import annotations

import pytest
from kafka import KafkaConsumer, KafkaProducer

from consumers.kafka import compat


def _consumer():
    # api_version given: nothing is asked of a broker (there is none at this address)
    return KafkaConsumer(
        bootstrap_servers="127.0.0.1:1", api_version=(2, 8), enable_auto_commit=False
    )


def test_the_installed_kafka_python_has_every_patched_part():
    c = _consumer()
    try:
        compat.check_consumer(c)
    finally:
        c.close()
    p = KafkaProducer(
        bootstrap_servers="127.0.0.1:1",
        api_version=(2, 8),
        transactional_id="compat-check",
        max_block_ms=100,
    )
    try:
        compat.check_producer(p, transactional=True)
    finally:
        compat.force_close(p, 1.0)


@pytest.mark.parametrize(
    "chain", [("_fetcher", "_next_partition_records"), ("_fetcher", "_paused_partition_records")]
)
def test_a_renamed_part_stops_with_one_line(chain):
    c = _consumer()
    try:
        delattr(getattr(c, chain[0]), chain[1])
        with pytest.raises(compat.KafkaPythonIncompatible) as err:
            compat.check_consumer(c)
        msg = str(err.value)
        assert "\n" not in msg and ".".join(chain) in msg
        assert f"tested with kafka-python {compat.TESTED}.x" in msg and "pip install" in msg
    finally:
        setattr(getattr(c, chain[0]), chain[1], {} if "paused" in chain[1] else None)
        c.close()


def test_unpark_lets_parked_records_back_only_when_the_slot_is_drained():
    c = _consumer()
    try:
        f = c._fetcher
        f._paused_partition_records = {"tp": object()}
        f._next_partition_records = []  # drained: falsy but not None
        compat.unpark(c)
        assert f._next_partition_records is None
        f._next_partition_records = [1]  # records still to give: left alone
        compat.unpark(c)
        assert f._next_partition_records == [1]
        f._paused_partition_records = {}
        f._next_partition_records = []  # nothing parked: left alone
        compat.unpark(c)
        assert f._next_partition_records == []
    finally:
        f._next_partition_records = None
        c.close()


class _Coordinator:
    """Stands in for kafka-python's coordinator: the three parts finish_join reads and sets."""

    def __init__(self, join_task, needed):
        self._join_task, self.needed, self.asked = join_task, needed, 0

    def need_rejoin(self):
        return self.needed

    def request_rejoin(self):
        self.asked += 1
        self.needed = True


@pytest.mark.parametrize(
    "join_task,needed,asked",
    [
        (object(), False, 1),  # a join in flight that no poll would await again: ask once more
        (object(), True, 0),  # a join the next poll awaits anyway
        (None, False, 0),  # no join under way
    ],
)
def test_finish_join_asks_again_only_for_a_join_no_poll_would_finish(join_task, needed, asked):
    c = _consumer()
    real = c._coordinator
    try:
        c._coordinator = _Coordinator(join_task, needed)
        compat.finish_join(c)
        assert c._coordinator.asked == asked
    finally:
        c._coordinator = real
        c.close()
