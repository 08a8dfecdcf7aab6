"""A group counter's check for records retention deleted before they were counted
(aggregator/service/group/counter.py, issue 46): a small jump looked at less than a second after
the last look is not forgotten: it is looked at before the window closes, so a window is never
released short of records deleted there. The Kafka consumer is replaced by the one answer the
check asks of it (the partition's first offset); the group's real-broker path is
tests/integration/test_group_outage_kafka.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

from kafka import TopicPartition

from aggregator.service.group.counter import Counter, SliceTask


class _FirstOffset:
    """What ``beginning_offsets`` answers: the partition's first offset, set by the test."""

    def __init__(self, low: int):
        self.low, self.asked = low, 0

    def beginning_offsets(self, tps):
        self.asked += 1
        return {tp: self.low for tp in tps}


class _Counter:
    """The counter's check and its verdict, over a stand-in consumer."""

    _check_deleted = Counter._check_deleted
    _note_deleted = Counter._note_deleted
    _deleted_reason = Counter._deleted_reason

    def __init__(self, low: int):
        self.consumer, self._low_checked = _FirstOffset(low), {}
        self.topics = SimpleNamespace(repartition="g.panagg.repartition")


def test_a_small_jump_right_after_a_look_is_looked_at_before_the_close():
    counter = _Counter(low=111)
    tp = TopicPartition("g.panagg.repartition", 1)
    task = SliceTask(1, 7, 104, 10, lambda: None)
    counter._low_checked[1] = time.monotonic()  # looked at a moment ago (a marker's jump)
    counter._check_deleted(task, tp, 7)  # records 104-110 deleted: a jump of 7
    assert counter.consumer.asked == 0 and task.deleted is None  # not looked at now
    assert task.unchecked_from == 104  # but remembered
    # what the close does first (Counter._close): the remembered jump is looked at
    counter._note_deleted(task, tp, task.unchecked_from)
    assert task.deleted == (104, 111)
    assert "deleted by the repartition topic's retention" in counter._deleted_reason(task, 150)


def test_a_jump_over_markers_only_withholds_nothing():
    counter = _Counter(low=0)  # nothing deleted: the jump was transaction markers
    tp = TopicPartition("g.panagg.repartition", 1)
    task = SliceTask(1, 7, 104, 10, lambda: None)
    counter._check_deleted(task, tp, 3)
    assert counter.consumer.asked == 1 and task.deleted is None
    assert counter._deleted_reason(task, 150) is None
