"""Allowed lateness of event-time windows (``window.allowed_lateness_s``): each record's window,
across read interleavings, late policies and lateness values, equals the one the definitions
give (a reference computed here, one partition at a time); a crash while two windows are live
and a replay with another interleaving reproduce every release.

The source is the in-memory stand-in for Kafka partitions of tests/test_event_time.py."""

from __future__ import annotations

import json

import pytest

from aggregator.service import publisher
from aggregator.service.config import ConfigError
from aggregator.service.process import Aggregator
from tests.helpers.event_time import SIZE, ListSource, cfg_for, reference, releases


# (timestamp s, item) per partition; items are unique, so each one names its record. Out of
# order within and across partitions: records behind their partition's latest timestamp by less
# than and by more than the lateness values below, a window no record falls in (9), a window
# (6) that counts within its predecessor's lateness while every partition waits beyond it (62,
# then 72 and 83) and gets a record after that (67), and a partition that ends early (t:2: idle
# while the others go on).
TIMES = {
    "t:0": [
        1,
        4,
        9,
        12,
        8,
        11,
        14,
        23,
        15,
        19,
        31,
        13,
        45,
        52,
        41,
        58,
        62,
        72,
        67,
        81,
        79,
        88,
        105,
    ],
    "t:1": [3, 2, 11, 7, 10, 19, 16, 9, 21, 18, 22, 29, 35, 27, 33, 47, 44, 83, 86, 117, 108],
    "t:2": [5, 13, 6, 24, 12, 20],
}
PARTS = {p: [(t, 100 * k + i) for i, t in enumerate(ts)] for k, (p, ts) in enumerate(TIMES.items())}
LATENESS = [0, 2.5, 5, 9]
INTERLEAVINGS = [(None, 1), (None, 3), (["t:2", "t:1", "t:0"], 2), (["t:1", "t:0", "t:2"], 100)]


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Release documents without their PNG plots (the plot is most of a release's time here)."""
    monkeypatch.setattr(publisher.ReleasePublisher, "_plot", lambda self, doc: None)


class Recording(Aggregator):
    """The aggregator, noting which window's state each item was counted in and which records
    went to dead letters as late."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.items_of: dict[int, tuple] = {}  # id(state) -> (state, [items])
        self.windows: dict[int, int] = {}  # event index -> id of the state released for it
        self.dead: list[tuple[str, int]] = []
        count, reject = self.intake.count, self.intake.reject

        def counting(state, items):
            self.items_of.setdefault(id(state), (state, []))[1].extend(int(i) for i in items)
            count(state, items)

        def rejecting(seg, i, reason, reasons):
            if reason == "late":
                self.dead.append((seg.partition, int(seg.offsets[i])))
            reject(seg, i, reason, reasons)

        self.intake.count, self.intake.reject = counting, rejecting

    def close_window(self):
        self.windows[self.task.window["event_index"]] = id(self.task.state)
        return super().close_window()

    def assignment(self) -> dict:
        where = {item: k for k, sid in self.windows.items() for item in self.items_of[sid][1]}
        where.update({PARTS[p][off][1]: "dead" for p, off in self.dead})
        return where


def expected_releases(windows: dict) -> list[dict]:
    return [
        {"event_start_unix": k * SIZE, "event_end_unix": (k + 1) * SIZE, "events": ev, "late": late}
        for k, (ev, late) in sorted(windows.items())
    ]


def settings(tmp_path, lateness, late, *sets):
    return cfg_for(
        tmp_path,
        "state.domain_size=400",
        f"window.late={late}",
        f"window.allowed_lateness_s={lateness}",
        *sets,
    )


@pytest.mark.parametrize("lateness", LATENESS)
@pytest.mark.parametrize("late", ["next", "dead_letter"])
def test_each_record_lands_in_the_window_the_definition_gives_whatever_the_interleaving(
    tmp_path, lateness, late
):
    where, windows = reference(PARTS, lateness, late)
    for n, (order, chunk) in enumerate(INTERLEAVINGS):
        out = tmp_path / str(n)
        agg = Recording(settings(out, lateness, late), ListSource(PARTS, order, chunk))
        agg.run()
        assert agg.assignment() == where, (order, chunk)
        assert releases(out) == expected_releases(windows), (order, chunk)
        assert agg.task.totals["events"] == sum(ev for ev, _ in windows.values())
        assert agg.task.totals["rejects"] == (
            {"late": sum(k == "dead" for k in where.values())} if "dead" in where.values() else {}
        )


def test_the_reference_exercises_lateness():
    """The data reach both sides of every lateness: the lateness moves records between windows,
    and the second window counts records while the first is open."""
    assignments = [reference(PARTS, lateness, "next")[0] for lateness in LATENESS]
    for a, b in zip(assignments, assignments[1:]):
        assert a != b
    where, windows = reference(PARTS, 5, "dead_letter")
    assert "dead" in where.values() and len(windows) >= 5


def two_windows_live(agg) -> bool:
    """A window counts within its lateness while the next one counts too, and the checkpoint
    starts a window that was the second one (it replays part of its records among records
    released before)."""
    second = agg.event_time.second
    return bool(second is not None and second.events and agg.task.durable.window.get("skip_until"))


@pytest.mark.parametrize("late", ["next", "dead_letter"])
@pytest.mark.parametrize("lateness", [2.5, 9])
def test_a_crash_while_two_windows_are_live_replays_every_release_exactly(tmp_path, lateness, late):
    _, windows = reference(PARTS, lateness, late)
    crashed = 0
    for stop_at in range(1, 60, 4):  # crash points before, in and after two-window phases
        run = tmp_path / str(stop_at)
        agg = Aggregator(settings(run, lateness, late), ListSource(PARTS, chunk=1))
        agg.restore()
        for _ in range(stop_at):
            for seg in agg.source.poll():
                agg._ingest(seg)
            agg.event_time.turn(agg.task)
        if not two_windows_live(agg):
            continue
        crashed += 1
        durable = agg.task.durable
        live = agg.task.window["events"] + agg.event_time.second.events
        # the checkpoint holds none of the live windows' events
        assert durable.totals["events"] + live == agg.task.totals["events"]
        del agg  # SIGKILL: nothing after the checkpoint is durable

        again = Aggregator(
            settings(run, lateness, late), ListSource(PARTS, ["t:2", "t:1", "t:0"], chunk=100)
        )
        again.run()
        assert releases(run) == expected_releases(windows), stop_at
        assert again.task.totals["events"] == sum(ev for ev, _ in windows.values())
    assert crashed >= 3  # the data have a two-window phase at several read positions


def drive(agg, steps=None) -> None:
    """The consume loop's event-time steps, for ``steps`` polls or to the input's end (then the
    open windows are released, as ``release.on_exhausted`` does)."""
    n = 0
    while steps is None or n < steps:
        n += 1
        segments = agg.source.poll()
        for seg in segments:
            agg._ingest(seg)
        agg.event_time.turn(agg.task)
        if not segments and agg.source.exhausted:
            while agg.task.window["events"]:
                agg.close_window()
            return


@pytest.mark.parametrize("lateness", [2.5, 9])
def test_a_release_request_while_two_windows_are_live_is_replayed_exactly(tmp_path, lateness):
    """A release request closes the open window where the partitions are (its close positions
    are then those, recorded in the ledger and the next checkpoint); a crash after it and a
    replay with another interleaving give the same releases, and every event is in one."""

    def until_two_windows(agg):
        agg.restore()
        while not (agg.event_time.second is not None and agg.event_time.second.events):
            drive(agg, 1)
        agg.close_window()  # `panagg release`

    ref = tmp_path / "ref"
    agg = Aggregator(settings(ref, lateness, "next"), ListSource(PARTS, chunk=1))
    until_two_windows(agg)
    drive(agg)
    expected = releases(ref)
    assert sum(w["events"] for w in expected) == sum(len(r) for r in PARTS.values())

    for steps in (1, 5, 15):
        run = tmp_path / str(steps)
        agg = Aggregator(settings(run, lateness, "next"), ListSource(PARTS, chunk=1))
        until_two_windows(agg)
        drive(agg, steps)
        del agg  # SIGKILL
        Aggregator(
            settings(run, lateness, "next"), ListSource(PARTS, ["t:1", "t:2", "t:0"], chunk=100)
        ).run()
        assert releases(run) == expected, steps


def test_lateness_zero_keeps_one_live_window(tmp_path):
    agg = Recording(settings(tmp_path, 0, "next"), ListSource(PARTS, chunk=1))
    agg.run()
    assert agg.event_time.second is None and len(agg.items_of) == len(releases(tmp_path))


def test_releases_say_the_allowed_lateness(tmp_path):
    Aggregator(settings(tmp_path, 2.5, "next"), ListSource(PARTS)).run()
    docs = [json.loads(p.read_text()) for p in (tmp_path / "releases").glob("*.json")]
    assert docs and {d["window_info"]["allowed_lateness_s"] for d in docs} == {2.5}


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["window.allowed_lateness_s=10"], "needs window.allowed_lateness_s < window.size"),
        (["window.allowed_lateness_s=-1"], "window.allowed_lateness_s must be >= 0"),
        (
            ["window.kind=time", "window.clock=process", "window.allowed_lateness_s=1"],
            "applies to window.kind = event_time only",
        ),
    ],
)
def test_lateness_config_errors_are_one_line(tmp_path, sets, fragment):
    with pytest.raises(ConfigError) as exc:
        cfg_for(tmp_path, *sets)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


class _Killed(Exception):
    pass


@pytest.mark.parametrize("workers", [0, 1], ids=["in-loop", "release-worker"])
@pytest.mark.parametrize("lateness", LATENESS)
def test_a_stop_after_a_release_is_ledgered_never_replays_that_window(tmp_path, lateness, workers):
    """The process stops after window k's release is in the ledger, before the checkpoint that
    opens the next window (issue 'One event, one charge', case 1): the restart publishes the
    ledgered release, does not count window k's records into memory again (only the records
    of the windows after it, the second window's included), and every release is exact."""
    _, windows = reference(PARTS, lateness, "next")
    for nth in (1, 2, 3):  # after the first, second and third release
        run = tmp_path / f"{nth}"
        agg = Aggregator(
            settings(run, lateness, "next", f"release.workers={workers}"),
            ListSource(PARTS, chunk=1),
        )
        save = agg.checkpoints.save

        def stop_after_release(task, record, nth=nth, agg=agg, save=save):
            if len(agg.ledger.releases()) >= nth:
                raise _Killed()  # SIGKILL: the checkpoint that opens the next window is lost
            return save(task, record)

        agg.checkpoints.save = stop_after_release
        with pytest.raises(_Killed):
            agg.run()
        ledgered = agg.ledger.releases()[-1]
        decided = json.loads(ledgered["document"])["window_info"]["events"]
        del agg

        again = Aggregator(
            settings(run, lateness, "next"), ListSource(PARTS, ["t:2", "t:1", "t:0"], chunk=100)
        )
        counted = []
        count = again.intake.count
        again.intake.count = lambda state, items: (counted.append(len(items)), count(state, items))
        again.run()
        assert releases(run) == expected_releases(windows), (nth, lateness)
        before = sum(
            json.loads(e["document"])["window_info"]["events"]
            for e in again.ledger.releases()[:nth]
        )
        # what the restart counted into memory: every event but those of the released windows
        # (the second window's records read before the stop are counted again: a restart entry)
        assert sum(counted) == sum(ev for ev, _ in windows.values()) - before, (nth, decided)
        uids = [e["window_uid"] for e in again.ledger.releases()]
        assert len(uids) == len(set(uids))
