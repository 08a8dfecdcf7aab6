"""Event-time windows (``window.kind = event_time``): assignment by record timestamp, late
records, rejects, and a replay after a crash assigning every record as the first run did.

The source is an in-memory stand-in for Kafka partitions whose poll order (the interleaving of
partitions) the test chooses, so cross-partition order is exact."""

from __future__ import annotations

import time

import pytest

from aggregator.service.config import ConfigError, load_config
from aggregator.service.process import Aggregator
from tests.helpers.event_time import ListSource, cfg_for, releases

NOW = time.time()


# A: 1 2 | 12 13 | 47 ; B: 5 3 8 | 15 4 (late)  -- window 0 closes once both partitions
# reached a record of a later window, whatever the interleaving; 47 opens window 4 (20-40 skipped)
PARTS = {
    "t:0": [(1, 1), (2, 2), (12, 3), (13, 4), (47, 5)],
    "t:1": [(5, 6), (3, 7), (8, 8), (15, 9), (4, 10)],
}


@pytest.mark.parametrize("late", ["next", "dead_letter"])
@pytest.mark.parametrize("order, chunk", [(None, 2), (["t:1", "t:0"], 1), (None, 100)])
def test_assignment_by_timestamp_and_late_records(tmp_path, late, order, chunk):
    agg = Aggregator(cfg_for(tmp_path, f"window.late={late}"), ListSource(PARTS, order, chunk))
    agg.run()
    got = releases(tmp_path)
    next_ = late == "next"
    assert got == [
        {"event_start_unix": 0, "event_end_unix": 10, "events": 5, "late": 0},
        {"event_start_unix": 10, "event_end_unix": 20, "events": 4 if next_ else 3, "late": 1},
        {"event_start_unix": 40, "event_end_unix": 50, "events": 1, "late": 0},
    ]
    assert agg.task.totals["rejects"] == ({} if next_ else {"late": 1})
    assert agg.task.totals["events"] == (10 if next_ else 9)


def test_missing_and_future_timestamps_are_rejected(tmp_path):
    parts = {"t:0": [(1, 1), (None, 2), (NOW + 3600, 3), (NOW + 10, 4), (4, 5)]}
    agg = Aggregator(cfg_for(tmp_path, "window.max_future_skew_s=60"), ListSource(parts))
    agg.run()
    assert agg.task.totals["rejects"] == {"no_timestamp": 1, "future_timestamp": 1}
    got = releases(tmp_path)
    assert [w["events"] for w in got] == [1, 2]  # 1 / now+10 and 4 (late: counted in it)
    assert got[1]["late"] == 1


def test_replay_after_a_crash_assigns_every_record_as_before(tmp_path):
    """Crash inside window 1 (after the checkpoint that opened it); the restart replays with
    the partitions interleaved otherwise, and the releases are the same."""
    ref = tmp_path / "ref"
    Aggregator(cfg_for(ref), ListSource(PARTS)).run()
    expected = releases(ref)

    run = tmp_path / "run"
    agg = Aggregator(cfg_for(run), ListSource(PARTS, chunk=1))
    agg.restore()
    while agg.task.window.get("event_index") != 1 or not agg.task.window["events"]:
        for seg in agg.source.poll():
            agg._ingest(seg)
    durable = agg.task.durable
    assert durable.offsets == {"t:0": 2, "t:1": 3} and durable.window["event_index"] == 1
    del agg  # SIGKILL: nothing after the checkpoint is durable

    Aggregator(cfg_for(run), ListSource(PARTS, ["t:1", "t:0"], chunk=100)).run()
    assert releases(run) == expected


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (
            ["source.kind=file", "source.path=x"],
            "window.kind = event_time needs source.kind = kafka",
        ),
        (["checkpoint.snapshots_per_window=2"], "does not support checkpoint.snapshots_per_window"),
        (["window.late=drop"], "window.late must be one of next, dead_letter"),
        (["window.max_future_skew_s=-1"], "window.max_future_skew_s must be >= 0"),
        (["window.size=1.5"], "window.size must be a whole number"),
    ],
)
def test_config_errors_are_one_line(tmp_path, sets, fragment):
    with pytest.raises(ConfigError) as exc:
        cfg_for(tmp_path, *sets)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


class _Clock:
    """The event-time module's clock, ``ahead`` seconds after the real one."""

    def __init__(self, ahead: float):
        self.ahead = ahead

    def time(self):
        return time.time() + self.ahead

    def monotonic(self):
        return time.monotonic()


def _future_parts() -> dict:
    """A record stamped 100 s after now (when the test runs: the module's NOW is from
    collection, minutes earlier in a full run) among window-0 records: with a 60 s skew it is a
    reject, but a clock 200 s later would take it (and jump to its window, making 12, 13 late)."""
    return {"t:0": [(1, 1), (time.time() + 100, 2), (2, 3), (12, 4), (13, 5)]}


@pytest.mark.parametrize("keep_log", [True, False])
def test_a_replay_rejects_a_future_record_again_whatever_the_clock(tmp_path, monkeypatch, keep_log):
    from aggregator.service import event_time as et

    skew = "window.max_future_skew_s=60"
    parts = _future_parts()
    ref = tmp_path / "ref"
    Aggregator(cfg_for(ref, skew), ListSource(parts)).run()
    expected = releases(ref)
    assert [w["events"] for w in expected] == [2, 2]

    run = tmp_path / "run"
    agg = Aggregator(cfg_for(run, skew), ListSource(parts, chunk=1))
    agg.restore()
    while not agg.task.totals["rejects"].get("future_timestamp"):
        for seg in agg.source.poll():
            agg._ingest(seg)
    assert (run / "state" / "future_rejects").read_text() == "t:0 1\n"
    del agg  # SIGKILL before window 0 closed: the replay reads the record again

    if not keep_log:  # negative control: without the decision, the later clock counts it
        (run / "state" / "future_rejects").unlink()
    monkeypatch.setattr(et, "time", _Clock(200.0))
    agg = Aggregator(cfg_for(run, skew), ListSource(parts))
    agg.run()
    if keep_log:
        assert releases(run) == expected
        assert agg.task.totals["rejects"] == {"future_timestamp": 1}
        # the next window's checkpoint no longer needs the position
        assert (run / "state" / "future_rejects").read_text() == ""
    else:
        assert releases(run) != expected


def test_time_windows_on_kafka_follow_the_records_timestamps_unless_told_otherwise(tmp_path):
    """window.kind = time on a Kafka source windows by the records' timestamps
    (window.clock = auto); process keeps this process's clock; where record time cannot apply
    auto keeps the clock and record refuses in one line."""
    base = ["source.kind=kafka", "source.topic=t", "window.kind=time", "window.size=30"]
    w = load_config(None, base, env={})["window"]
    assert (w["kind"], w["auto_event_time"], w["idle_partition_timeout_s"]) == (
        "event_time",
        True,
        30.0,
    )
    assert load_config(None, base + ["window.clock=process"], env={})["window"]["kind"] == "time"
    assert load_config(None, base + ["scale.partitioned=true"], env={})["window"]["kind"] == "time"
    for sets, line in [
        (
            ["source.kind=file", "source.path=x", "window.clock=record"],
            "window.clock = record needs source.kind = "
            "kafka (record timestamps are Kafka's; a file "
            "source has none)",
        ),
        (
            ["window.kind=count", "window.clock=process"],
            "window.clock = process applies to window.kind = time only; remove it",
        ),
    ]:
        with pytest.raises(ConfigError) as exc:
            load_config(None, base + sets, env={})
        assert str(exc.value) == line


def test_a_directory_started_with_clock_time_windows_keeps_them(tmp_path, caplog):
    """A state directory whose ledger records processing-time windows (started before
    window.clock, or with window.clock = process) keeps them under window.clock = auto."""
    sets = ["window.kind=time", "window.size=10"]
    first = Aggregator(cfg_for(tmp_path, *sets, "window.clock=process"), ListSource(PARTS))
    first.run()
    assert first.ledger.identity()["window"] == "time:10"
    cfg = cfg_for(tmp_path, *sets)
    assert cfg.window.kind == "event_time"
    with caplog.at_level("INFO", logger="panagg.service"):
        again = Aggregator(cfg, ListSource(PARTS))
    # the start keeps the directory's windows in its own config; the caller's is not edited
    assert again.cfg.window.kind == "time" and not again.cfg.window.auto_event_time
    assert cfg.window.kind == "event_time"
    assert (
        "counts time windows by this process's clock (it was started so): it keeps them"
        in caplog.text
    )
    again.run()  # no identity refusal: the same settings
