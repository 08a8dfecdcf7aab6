"""The pan-private state: counting, modes, layers, merge, snapshots."""

import math

import msgpack
import numpy as np
import pytest

from aggregator.state import SNAPSHOT_FIELDS, PanPrivateHistogram, SnapshotError


def test_direct_update_adds_exact_counts():
    s = PanPrivateHistogram(epsilon=1.0, size=50)
    start = s.counts.copy()
    items = np.random.default_rng(0).integers(0, 50, 1000)
    s.update(items)
    assert np.array_equal(s.counts - start, np.bincount(items, minlength=50))
    assert s.n == 1000 and s.layers == 1


def test_small_batches_take_the_sparse_path_with_the_same_result():
    s = PanPrivateHistogram(epsilon=1.0, size=100_000)
    start = s.counts.copy()
    s.update([5, 5, 99_999])  # 8 * 3 < size: np.add.at path
    diff = s.counts - start
    assert diff[5] == 2 and diff[99_999] == 1 and diff.sum() == 3


def test_contract_is_explicit():
    s = PanPrivateHistogram(epsilon=1.0, size=3)
    assert s.neighbor == "replace-one" and s.sensitivity == 2
    assert s.p >= math.exp(-0.5) and s.p - math.exp(-0.5) < 1e-15
    t = PanPrivateHistogram(epsilon=1.0, size=3, neighbor="add-remove")
    assert t.sensitivity == 1 and t.p >= math.exp(-1.0)


def test_out_of_range_batch_is_rejected_whole_and_names_no_item():
    s = PanPrivateHistogram(epsilon=1.0, size=10)
    before = s.counts.copy()
    with pytest.raises(ValueError) as err:
        s.update([1, 2, 987654321])
    assert "987654321" not in str(err.value) and "[0, 10)" in str(err.value)
    assert np.array_equal(s.counts, before) and s.n == 0
    with pytest.raises(ValueError):
        s.update([-1])
    with pytest.raises(TypeError):
        s.update(["a"])
    with pytest.raises(TypeError):
        s.update([1.5])


@pytest.mark.parametrize("kwargs", [dict(), dict(size=3, buckets=3), dict(size=0),
                                    dict(size=3, neighbor="user-level"), dict(size=3, epsilon=-1),
                                    dict(size=3, key=b"x" * 16), dict(buckets=3, key=b"short")])
def test_bad_construction_raises(kwargs):
    kwargs = dict(epsilon=1.0) | kwargs
    with pytest.raises(ValueError):
        PanPrivateHistogram(**kwargs)


def test_counts_are_read_only():
    s = PanPrivateHistogram(epsilon=1.0, size=5)
    with pytest.raises(ValueError):
        s.counts[0] = 7


def test_hashed_mode_maps_items_consistently():
    s = PanPrivateHistogram(epsilon=2.0, buckets=1000)
    start = s.counts.copy()
    s.update(["alice", "bob", "alice", 42, b"bob"])
    diff = s.counts - start
    assert diff.sum() == 5 and s.n == 5
    idx = s.index_of(["alice", "bob", 42, "42"])
    assert diff[idx[0]] >= 2 and diff[idx[1]] >= 2
    assert idx[2] == idx[3]  # int 42 and "42" are the same item
    # the key travels with the snapshot, so a restored state counts into the same buckets
    t = PanPrivateHistogram.deserialize(s.serialize())
    assert np.array_equal(t.index_of(["alice", "bob"]), idx[:2])


def test_rerandomize_adds_a_layer():
    s = PanPrivateHistogram(epsilon=1.0, size=2000)
    before = s.counts.copy()
    s.rerandomize()
    assert s.layers == 2
    added = s.counts - before
    assert added.var() > 0.5 * 2 * s.p / (1 - s.p) ** 2


def test_merge_adds_counts_layers_and_n():
    a = PanPrivateHistogram(epsilon=1.0, size=20)
    b = PanPrivateHistogram(epsilon=1.0, size=20)
    a.update([1, 2, 3])
    b.update([3, 4])
    total = a.counts + b.counts
    a.merge(b)
    assert np.array_equal(a.counts, total) and a.layers == 2 and a.n == 5
    with pytest.raises(ValueError):
        a.merge(PanPrivateHistogram(epsilon=2.0, size=20))
    with pytest.raises(ValueError):
        a.merge(PanPrivateHistogram(epsilon=1.0, size=21))
    with pytest.raises(ValueError):
        PanPrivateHistogram(epsilon=1.0, buckets=20).merge(PanPrivateHistogram(epsilon=1.0, buckets=20))


def test_snapshot_round_trip_and_fields():
    s = PanPrivateHistogram(epsilon=0.5, size=100, neighbor="add-remove")
    s.update(np.arange(100))
    s.rerandomize()
    blob = s.serialize()
    assert set(msgpack.unpackb(blob, raw=False)) == SNAPSHOT_FIELDS
    t = PanPrivateHistogram.deserialize(blob)
    assert np.array_equal(t.counts, s.counts)
    assert (t.n, t.layers, t.p, t.epsilon, t.neighbor, t.mode) == \
        (s.n, s.layers, s.p, s.epsilon, s.neighbor, s.mode)
    t.update([0])  # restored counters are writable and independent
    assert t.counts[0] == s.counts[0] + 1


def test_corrupt_snapshots_are_refused():
    s = PanPrivateHistogram(epsilon=1.0, size=64)
    blob = bytearray(s.serialize())
    blob[-40] ^= 0x01  # flip one bit inside the counters or checksum
    with pytest.raises(SnapshotError):
        PanPrivateHistogram.deserialize(bytes(blob))
    with pytest.raises(SnapshotError):
        PanPrivateHistogram.deserialize(s.serialize()[:-10])
    with pytest.raises(SnapshotError):
        PanPrivateHistogram.deserialize(b"not msgpack at all \xff\xfe")
    with pytest.raises(SnapshotError):
        PanPrivateHistogram.deserialize(msgpack.packb({"format": "something else"}))
