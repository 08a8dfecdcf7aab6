"""How KafkaSource turns a poll's ConsumerRecords into Segments (no broker needed)."""

import numpy as np
from kafka.consumer.fetcher import ConsumerRecord

from consumers.base import Segment, offsets_array
from consumers.kafka.kafka_python import _HEADERS, _KEY, RecordColumn, _offsets


def records(offsets, keys=None, headers=None):
    keys = keys or [None] * len(offsets)
    headers = headers or [[] for _ in offsets]
    return [
        ConsumerRecord("t", 0, 0, off, 0, 0, k, b"v%d" % off, h, None, -1, 2, -1)
        for off, k, h in zip(offsets, keys, headers)
    ]


def test_consecutive_offsets_are_a_range_and_gaps_a_list():
    assert _offsets(records([5, 6, 7])) == range(5, 8)
    assert isinstance(_offsets(records([5, 6, 7])), range)
    gappy = _offsets(records([5, 7, 8]))  # compaction or a transaction marker in between
    assert gappy == [5, 7, 8] and isinstance(gappy, list)
    assert _offsets(records([9])) == range(9, 10)


def test_offsets_array_is_the_same_for_a_range_and_a_list():
    for offsets in (range(3, 10), list(range(3, 10)), [1, 4, 9], range(0, 0)):
        arr = offsets_array(offsets)
        assert arr.dtype == np.int64 and arr.tolist() == list(offsets)


def test_record_column_reads_like_the_list_it_replaces():
    recs = records(
        [1, 2, 3, 4], keys=[b"a", None, b"c", b"d"], headers=[[], [("h", b"x")], [], [("h", None)]]
    )
    keys, headers = RecordColumn(recs, _KEY), RecordColumn(recs, _HEADERS)
    assert len(keys) == 4 and keys[0] == b"a" and keys[1] is None and keys[-1] == b"d"
    assert list(keys) == [b"a", None, b"c", b"d"] and keys == [b"a", None, b"c", b"d"]
    assert keys[1:3] == [None, b"c"] and len(keys[2:]) == 2 and keys[2:][0] == b"c"
    assert headers[1] == [("h", b"x")] and list(headers) == [[], [("h", b"x")], [], [("h", None)]]
    assert keys != [b"a"] and keys != "abcd"


def test_a_segment_cut_like_the_partitioned_service_cuts_it():
    recs = records([10, 11, 12, 13], keys=[b"0", b"1", b"2", b"3"])
    seg = Segment(
        "t:0",
        _offsets(recs),
        [r.value for r in recs],
        RecordColumn(recs, _KEY),
        RecordColumn(recs, _HEADERS),
    )
    cut = int(np.searchsorted(offsets_array(seg.offsets), 12))
    tail = Segment(
        seg.partition, seg.offsets[cut:], seg.values[cut:], seg.keys[cut:], seg.headers[cut:]
    )
    assert list(tail.offsets) == [12, 13] and tail.values == [b"v12", b"v13"]
    assert list(tail.keys) == [b"2", b"3"] and len(tail) == 2
