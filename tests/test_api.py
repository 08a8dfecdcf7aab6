"""The public Python API (aggregator/api.py, issue 54): the service's aggregator fed by the
caller, with the service's decoder, ledger, checkpoints and exactly-once offsets."""

import json

import msgpack
import numpy as np
import pytest

from aggregator.api import Aggregation, Release, ReleaseRefused, settings
from aggregator.release import make_release
from aggregator.service.config import ConfigError
from aggregator.state import PanPrivateHistogram

D, SEED = 500, 7


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def cfg_for(tmp_path, **extra):
    values = {
        "checkpoint.dir": tmp_path / "state",
        "release.dir": tmp_path / "releases",
        "state.domain_size": D,
        "window.kind": "count",
        "window.size": 1000,
        "metrics.port": -1,
        "testing.noise_seed": SEED,
        "release.plan_errors": False,
        "source.topic": "logins",
    }
    values.update(extra)
    return settings(settings=values, env={})


def items(k, seed=1):
    return np.random.default_rng(seed).integers(0, D, k).tolist()


def expected_document(xs, window):
    """What the service releases for window ``window`` holding exactly ``xs`` (its test noise:
    tests/test_service.py)."""
    state = PanPrivateHistogram(1.0, size=D, rng=np.random.default_rng([SEED, 0, window]))
    state.add_indices(np.asarray(xs, dtype=np.int64))
    return make_release(
        state, model="joint", window=window, rng=np.random.default_rng([SEED, 1, window])
    )


def same_figures(doc, expected):
    """(The intervals are bootstrap draws the service makes itself: not compared.)"""
    for key in ("histogram", "properties", "n", "epsilon", "p", "layers"):
        assert doc[key] == expected[key], key
    assert (
        doc["headline"]["distinct_items"]["value"]
        == expected["headline"]["distinct_items"]["value"]
    )


def test_count_windows_release_what_the_service_would(tmp_path):
    xs = items(2500)
    with Aggregation(cfg_for(tmp_path)) as agg:
        made = agg.feed(xs)
        assert [r.window for r in made] == [0, 1] and agg.window == 2
        last = agg.release()
    for r, part in zip([*made, last], [xs[:1000], xs[1000:2000], xs[2000:]]):
        same_figures(r.document, expected_document(part, r.window))
        assert r.ledger["kind"] == "release" and r.epsilon_spent == 1.0
        assert r.ledger["n"] == len(part) == r.n and "document" not in r.ledger
        assert r.document["counted"] == {"stream": "kafka:logins", "item": "value:item"}
    head = last.document["headline"]
    assert last.distinct_items.value == head["distinct_items"]["value"]
    assert list(last.distinct_items.interval) == head["distinct_items"]["interval"]
    assert last.privacy_unit == "event" and last.epsilon == 1.0
    assert last.histogram and all(
        a > b for (a, _), (b, _) in zip(last.histogram, last.histogram[1:])
    )
    # every release is a file in release.dir, and reads back as the same release
    for r in [*made, last]:
        assert (
            Release.read(tmp_path / "releases" / f"release-{r.window}.json") == r.without_ledger()
        )
    assert Release.from_ledger(tmp_path / "state" / "ledger.jsonl") == [*made, last]


def test_feed_records_decodes_as_the_service_and_sorts_bad_records(tmp_path):
    good = items(300)
    values = [json.dumps({"user": {"id": i}}).encode() for i in good]
    values[5:5] = [
        b"not json",
        json.dumps({"user": {}}).encode(),
        json.dumps({"user": {"id": D + 3}}).encode(),
    ]
    cfg = cfg_for(tmp_path, **{"source.format": "json", "item.field": "user.id"})
    with Aggregation(cfg) as agg:
        assert agg.feed_records(values) == []
        assert agg.position() == len(values)
        rel = agg.release()
    same_figures(rel.document, expected_document(good, 0))
    assert rel.ledger["totals"]["rejects"] == {
        "undecodable": 1,
        "missing_item": 1,
        "out_of_range": 1,
    }


def test_feed_builds_records_of_the_configured_format(tmp_path):
    xs = items(400, seed=3)
    cfg = cfg_for(tmp_path, **{"item.field": "a.b"})
    with Aggregation(cfg) as agg:
        rel = agg.feed(xs) or [agg.release()]
    same_figures(rel[0].document, expected_document(xs, 0))
    assert msgpack.unpackb(msgpack.packb({"a": {"b": 1}}))["a"]["b"] == 1


def test_a_restart_resumes_at_the_open_window_and_counts_each_record_once(tmp_path):
    """Offsets, as a Kafka consumer would pass them: the records of the released window are
    skipped at the restart, the open window's are counted again (under fresh noise), once."""
    xs = items(1600, seed=4)
    vals = [msgpack.packb({"item": i}) for i in xs]
    with Aggregation(cfg_for(tmp_path)) as agg:
        assert [
            r.window
            for r in agg.feed_records(vals[:1300], partition="logins:0", offsets=range(100, 1400))
        ] == [0]
        assert agg.position("logins:0") == 1400
    with Aggregation(cfg_for(tmp_path)) as agg:
        assert agg.resume_offsets == {"logins:0": 1100} and agg.window == 1
        assert agg.feed_records(vals, partition="logins:0", offsets=range(100, 1700)) == []
        rel = agg.release()
    assert rel.n == 600
    same_figures(rel.document, expected_document(xs[1000:], 1))
    kinds = [
        json.loads(x)["kind"]
        for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
    ]
    assert kinds.count("release") == 2 and "restart" in kinds


def test_records_fed_without_offsets_follow_on_after_a_restart(tmp_path):
    xs = items(700, seed=5)
    with Aggregation(cfg_for(tmp_path)) as agg:
        agg.feed(xs[:400])
    with Aggregation(cfg_for(tmp_path)) as agg:
        assert agg.resume_offsets == {} and agg.position() == 0  # window 0 was never closed
        agg.feed(xs)
        rel = agg.release()
    assert rel.window == 0 and rel.n == 700


def test_the_ledger_refuses_past_the_budget(tmp_path):
    with Aggregation(cfg_for(tmp_path, **{"ledger.budget_total": 1.0})) as agg:
        agg.feed(items(1000))  # window 0: 1 eps, the whole budget
        agg.feed(items(10))
        with pytest.raises(ReleaseRefused, match="window 1 was refused by the ledger: .*budget"):
            agg.release()
    entries = [
        json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()
    ]
    assert [e["kind"] for e in entries if e["kind"] in ("release", "refused")] == [
        "release",
        "refused",
    ]


def test_one_aggregation_per_directory_and_bad_settings_in_one_line(tmp_path):
    with Aggregation(cfg_for(tmp_path)):
        with pytest.raises(Exception, match="another panagg"):
            Aggregation(cfg_for(tmp_path))
    with pytest.raises(ConfigError, match="state.epsilon"):
        cfg_for(tmp_path, **{"state.epsilon": "lots"})


def test_nothing_unnoised_is_shown(tmp_path):
    """The public surface: no count of the open window, in attributes or the repr."""
    with Aggregation(cfg_for(tmp_path)) as agg:
        agg.feed([3] * 777)
        public = {n for n in dir(agg) if not n.startswith("_")}
        assert public == {
            "config",
            "stream",
            "window",
            "resume_offsets",
            "position",
            "feed",
            "feed_records",
            "tick",
            "release",
            "close_window",
            "releases",
            "close",
        }
        assert all(k.startswith("_") for k in vars(agg))
        assert "777" not in repr(agg) and agg.position() == 777  # (a position, not a count)
        rel = agg.release()
    assert "777" in repr(rel)  # n is public in a release (replace-one neighbours)
    with pytest.raises(RuntimeError, match="closed"):
        agg.feed([1])


def test_read_refuses_what_is_not_a_release(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"format": "something"}))
    with pytest.raises(ValueError, match="not a panagg release"):
        Release.read(path)


def crash_at_the_checkpoint_after_a_release(agg, feed):
    """``feed()`` closes a window: the ledger gets its release, the process dies before the
    checkpoint that starts the next window."""
    from aggregator.service import process

    def crash(self, task, **kw):
        raise RuntimeError("killed before the checkpoint")

    original = process.Aggregator.commit
    process.Aggregator.commit = crash
    try:
        with pytest.raises(RuntimeError, match="killed"):
            feed()
    finally:
        process.Aggregator.commit = original
    agg._agg.close()  # (the process is gone: its lock with it)


def _crashed_after_window_0(tmp_path):
    """Two partitions fed, window 0 released from A's 600 and B's 300 records, then a crash
    at the checkpoint after B's next 200: returns the items and both partitions' records."""
    xs = items(1400, seed=6)
    a = [msgpack.packb({"item": i}) for i in xs[:700]]
    b = [msgpack.packb({"item": i}) for i in xs[700:]]
    agg = Aggregation(cfg_for(tmp_path))
    agg.feed_records(a[:600], partition="A")
    agg.feed_records(b[:300], partition="B")
    crash_at_the_checkpoint_after_a_release(
        agg, lambda: agg.feed_records(b[300:500], partition="B", offsets=range(300, 500))
    )
    return xs, a, b


def test_a_window_ledgered_before_a_crash_is_not_counted_again(tmp_path):
    xs, a, b = _crashed_after_window_0(tmp_path)
    with Aggregation(cfg_for(tmp_path)) as agg:
        # the ledgered window is passed: the next starts at its ledgered end
        assert agg.window == 1 and agg.resume_offsets == {"A": 600, "B": 400}
        assert agg.feed_records(a, partition="A", offsets=range(700)) == []
        assert agg.feed_records(b, partition="B", offsets=range(700)) == []
        rel = agg.release()
    assert rel.window == 1 and rel.n == 400
    same_figures(rel.document, expected_document(xs[600:700] + xs[1100:], 1))
    assert [r.window for r in Release.from_ledger(tmp_path / "state" / "ledger.jsonl")] == [0, 1]


def test_a_replay_held_in_one_partition_keeps_its_later_records(tmp_path, monkeypatch):
    """The same crash, restarted as a state directory that replays the ledgered window to its
    ledgered end in each partition (a checkpoint listing windows released beside the loop by
    a service with release.workers > 0 does so: forced here). Partition A reaches its end
    first and is held there; its later records are window 1's, counted once window 0 closes
    (not dropped)."""
    from aggregator.service.stages.resume import Resume

    xs, a, b = _crashed_after_window_0(tmp_path)
    monkeypatch.setattr(Resume, "skip_decided_window", lambda self, task: False)
    with Aggregation(cfg_for(tmp_path)) as agg:
        assert agg.window == 0 and agg.resume_offsets == {}
        assert agg.feed_records(a, partition="A") == []  # held at 600: 100 kept back
        assert agg.position("A") == 600
        assert agg.feed_records(b, partition="B") == []  # window 0: from the ledger
        assert agg.position("A") == 700 and agg.window == 1
        rel = agg.release()
    assert rel.window == 1 and rel.n == 400
    same_figures(rel.document, expected_document(xs[600:700] + xs[1100:], 1))


def test_time_windows_by_this_process_clock_and_what_is_not_driven_yet(tmp_path):
    with pytest.raises(ConfigError, match="window.clock = process"):
        Aggregation(cfg_for(tmp_path, **{"window.kind": "time", "window.size": 60}))
    cfg = cfg_for(tmp_path, **{"window.kind": "time", "window.size": 1, "window.clock": "process"})
    with Aggregation(cfg) as agg:
        assert agg.feed(items(300)) == []
        import time

        time.sleep(1.1)
        made = agg.tick()
    assert [r.window for r in made] == [0] and made[0].n == 300
