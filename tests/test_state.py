"""The pan-private state: counting, modes, layers, merge, snapshots, and what add-remove hides."""

import hashlib
import json
import math

import msgpack
import numpy as np
import pytest

from aggregator import release as release_mod
from aggregator.release import MODELS, make_release, write_release
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


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(size=3, buckets=3),
        dict(size=0),
        dict(size=3, neighbor="user-level"),
        dict(size=3, epsilon=-1),
        dict(size=3, key=b"x" * 16),
        dict(buckets=3, key=b"short"),
    ],
)
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
        PanPrivateHistogram(epsilon=1.0, buckets=20).merge(
            PanPrivateHistogram(epsilon=1.0, buckets=20)
        )


def test_snapshot_round_trip_and_fields():
    s = PanPrivateHistogram(epsilon=0.5, size=100)
    s.update(np.arange(100))
    s.rerandomize()
    blob = s.serialize()
    body = msgpack.unpackb(blob, raw=False)
    assert set(body) == SNAPSHOT_FIELDS and body["n"] == 100  # replace-one: n is public
    t = PanPrivateHistogram.deserialize(blob)
    assert np.array_equal(t.counts, s.counts)
    assert (t.n, t.layers, t.p, t.epsilon, t.neighbor, t.mode) == (
        s.n,
        s.layers,
        s.p,
        s.epsilon,
        s.neighbor,
        s.mode,
    )
    t.update([0])  # restored counters are writable and independent
    assert t.counts[0] == s.counts[0] + 1


def _resealed(blob: bytes, **fields) -> bytes:
    """``blob`` with header fields changed and a valid checksum: only the field rules refuse it."""
    body = msgpack.unpackb(blob, raw=False)
    counts, _ = body.pop("counts"), body.pop("checksum")
    body.update(fields)
    digest = hashlib.sha256(msgpack.packb(body, use_bin_type=True))
    digest.update(counts)
    return msgpack.packb(dict(body, counts=counts, checksum=digest.digest()), use_bin_type=True)


# -- add-remove: the event count differs between neighbours, so it is nowhere -------------------
def test_add_remove_state_holds_no_event_count():
    states = [PanPrivateHistogram(epsilon=1.0, size=5, neighbor="add-remove") for _ in range(3)]
    states[1].update([1])
    states[2].update([1, 2, 3, 3])
    for s in states:
        with pytest.raises(AttributeError, match="add-remove neighbors differ by one event"):
            s.n
        assert getattr(s, "n", None) is None
    # an intrusion into the live object finds nothing but the counters that depends on the data
    rest = [{k: v for k, v in vars(s).items() if k != "_counts"} for s in states]
    assert rest[0] == rest[1] == rest[2]


@pytest.mark.parametrize("kw", [dict(size=50), dict(buckets=50)])
def test_add_remove_snapshot_carries_nil_n_and_round_trips(kw):
    s = PanPrivateHistogram(epsilon=0.5, neighbor="add-remove", **kw)
    s.update([1, 2, 3, 4, 4])
    s.rerandomize()
    blob = s.serialize()
    body = msgpack.unpackb(blob, raw=False)
    assert set(body) == SNAPSHOT_FIELDS and body["n"] is None
    t = PanPrivateHistogram.deserialize(blob)
    assert np.array_equal(t.counts, s.counts)
    assert (t.layers, t.p, t.epsilon, t.neighbor, t.mode, t.key) == (
        s.layers,
        s.p,
        s.epsilon,
        s.neighbor,
        s.mode,
        s.key,
    )
    assert getattr(t, "n", None) is None
    t.update([0])  # a restored add-remove state counts on without starting a count
    assert msgpack.unpackb(t.serialize(), raw=False)["n"] is None


@pytest.mark.parametrize("n", [0, 5])
def test_add_remove_snapshot_with_a_count_is_refused(n):
    s = PanPrivateHistogram(epsilon=1.0, size=8, neighbor="add-remove")
    s.update([1, 2, 3, 4, 5])
    PanPrivateHistogram.deserialize(_resealed(s.serialize()))  # resealing alone is accepted
    with pytest.raises(SnapshotError, match="add-remove snapshot must not carry n"):
        PanPrivateHistogram.deserialize(_resealed(s.serialize(), n=n))


def test_replace_one_snapshot_without_a_count_is_refused():
    s = PanPrivateHistogram(epsilon=1.0, size=8)
    with pytest.raises(SnapshotError, match="replace-one snapshot must carry n"):
        PanPrivateHistogram.deserialize(_resealed(s.serialize(), n=None))
    with pytest.raises(SnapshotError, match="negative"):
        PanPrivateHistogram.deserialize(_resealed(s.serialize(), n=-1))


def test_repr_shows_n_only_when_public():
    r = PanPrivateHistogram(epsilon=1.0, size=4)
    r.update([1, 2, 3])
    assert repr(r) == (
        "PanPrivateHistogram(epsilon=1.0, size=4, neighbor='replace-one', layers=1, n=3)"
    )
    a = PanPrivateHistogram(epsilon=1.0, buckets=4, neighbor="add-remove")
    a.update(["x", "y", "z"])
    assert repr(a) == "PanPrivateHistogram(epsilon=1.0, buckets=4, neighbor='add-remove', layers=1)"


def test_merge_add_remove_states():
    a = PanPrivateHistogram(epsilon=1.0, size=20, neighbor="add-remove")
    b = PanPrivateHistogram(epsilon=1.0, size=20, neighbor="add-remove")
    a.update([1, 2, 3])
    b.update([3, 4])
    total = a.counts + b.counts
    assert a.merge(b) is a
    assert np.array_equal(a.counts, total) and a.layers == 2
    assert getattr(a, "n", None) is None
    assert msgpack.unpackb(a.serialize(), raw=False)["n"] is None
    for x, y in (
        (a, PanPrivateHistogram(epsilon=1.0, size=20)),
        (PanPrivateHistogram(epsilon=1.0, size=20), b),
    ):
        with pytest.raises(ValueError, match="neighbor"):
            x.merge(y)


def _spy_estimator(monkeypatch) -> list:
    """Record the n that make_release hands to the estimator (which still runs)."""
    seen = []
    real = release_mod.anonymized_histogram

    def spy(*args, **kwargs):
        seen.append(kwargs.get("n"))
        return real(*args, **kwargs)

    monkeypatch.setattr(release_mod, "anonymized_histogram", spy)
    return seen


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kw", [dict(size=200), dict(buckets=200)])
def test_make_release_of_add_remove_state_has_no_n(monkeypatch, tmp_path, model, kw):
    seen = _spy_estimator(monkeypatch)
    s = PanPrivateHistogram(epsilon=2.0, neighbor="add-remove", **kw)
    s.update([1] * 30 + [2] * 20 + [3] * 5 if "size" in kw else ["a"] * 30 + ["b"] * 20)
    rel = make_release(s, model=model, window=7)
    assert rel["n"] is None and seen == [None]
    assert rel["neighbor"] == "add-remove" and rel["model"] == model
    assert rel["n_in_histogram"] == sum(r * c for r, c in rel["histogram"]["pairs"])
    path = write_release(rel, tmp_path)  # JSON null, and the plot titles with n_in_histogram
    assert json.loads(path.read_text())["n"] is None
    assert (tmp_path / "release-7.png").exists()
    assert s.layers == 1  # the state is not modified


def test_make_release_of_add_remove_state_refuses_l2():
    s = PanPrivateHistogram(epsilon=1.0, size=50, neighbor="add-remove")
    s.update([1, 2, 2])
    with pytest.raises(ValueError, match="add-remove"):
        make_release(s, loss="l2")


@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_make_release_of_replace_one_state_publishes_n(monkeypatch, loss):
    seen = _spy_estimator(monkeypatch)
    s = PanPrivateHistogram(epsilon=2.0, size=100)
    s.update([1] * 30 + [2] * 10)
    rel = make_release(s, loss=loss)
    assert rel["n"] == s.n == 40 and seen == [40]


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


_PLOTS_FROM_THREADS = """
import sys, threading
from aggregator.release import plot_release
release = {"n": 1000, "n_in_histogram": 1000, "epsilon": 1.0, "model": "pan-private",
           "histogram": {"pairs": [[r, 3] for r in range(1, 60)]}}
failed = []
def draw(j):
    for k in range(5):
        try:
            plot_release(dict(release, window=f"{j}-{k}"), sys.argv[1])
        except Exception as exc:
            failed.append(type(exc).__name__)
threads = [threading.Thread(target=draw, args=(j,)) for j in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sorted(set(failed)))
"""


def test_plots_drawn_from_several_threads_at_once_all_succeed(tmp_path):
    # one plot thread per aggregation: matplotlib shares its fonts between figures, and without
    # the drawing lock most of these raised or the process aborted (a separate process, so an
    # abort fails this test instead of the whole suite)
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _PLOTS_FROM_THREADS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
    pngs = sorted(tmp_path.glob("release-*.png"))
    assert len(pngs) == 20
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
