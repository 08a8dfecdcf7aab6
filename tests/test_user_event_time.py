"""Event-time windows under the user unit (``window.kind = event_time`` with
``state.privacy_unit = "user"``): each event-time window's state is a density state, records
are assigned by their Kafka timestamps exactly as for the event unit, and a replay after a
crash assigns them again into fresh bits, its ``restart`` entries charged to every user.

The source is tests/test_event_time.py's in-memory stand-in for Kafka partitions (no broker).
With ``window.allowed_lateness_s`` > 0 two windows are live at once, and a crash replays both:
each is charged its restart.
"""

from __future__ import annotations

import json

import numpy as np

from aggregator.service.config import load_config
from aggregator.service.process import Aggregator
from tests.helpers.event_time import ListSource

USERS = 400  # distinct users per event-time window


def cfg_for(tmp_path, *sets):
    return load_config(
        None,
        [
            "source.kind=kafka",
            "source.topic=t",
            "source.format=json",
            "window.kind=event_time",
            "window.size=10",
            "state.privacy_unit=user",
            f"state.expected_users={USERS}",
            "ledger.budget_per_user=100",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "window.idle_partition_timeout_s=0.05",
            *sets,
        ],
        env={},
    )


def login_parts(windows: int = 3, seed: int = 4) -> tuple[dict, list[int]]:
    """Two partitions of (timestamp, user) records: event-time window w (10 s) holds USERS
    distinct users of its own with 3 logins each, the partitions' records interleaved in
    time; returns the partitions and each window's distinct users."""
    rng = np.random.default_rng(seed)
    parts: dict[str, list] = {"t:0": [], "t:1": []}
    for w in range(windows):
        recs = [
            (10 * w + float(rng.uniform(0, 10)), f"u{w}-{i}")
            for i in range(USERS)
            for _ in range(3)
        ]
        recs.sort()
        for j, rec in enumerate(recs):
            parts[f"t:{j % 2}"].append(rec)
    return parts, [USERS] * windows


def docs(tmp_path) -> list[dict]:
    out = [json.loads(p.read_text()) for p in (tmp_path / "releases").glob("release-*.json")]
    return sorted(out, key=lambda d: d["window_info"]["event_start_unix"])


def ledger(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()]


def windows_of(got: list[dict]) -> list[tuple]:
    return [(d["window_info"]["event_start_unix"], d["window_info"]["events"], d["n"]) for d in got]


def test_event_time_windows_release_each_windows_users(tmp_path):
    parts, truth = login_parts()
    Aggregator(cfg_for(tmp_path), ListSource(parts, chunk=50)).run()
    got = docs(tmp_path)
    assert windows_of(got) == [
        (0, 3 * USERS, 3 * USERS),
        (10, 3 * USERS, 3 * USERS),
        (20, 3 * USERS, 3 * USERS),
    ]
    for d, users in zip(got, truth):
        assert d["privacy_unit"] == "user" and d["window_info"]["kind"] == "event_time"
        lo, hi = d["distinct_users"]["interval"]
        assert lo - 0.3 * users <= users <= hi + 0.3 * users  # (loose: 3 draws, not coverage)
    charges = [e["user_epsilon"] for e in ledger(tmp_path) if e["kind"] == "release"]
    assert charges == [1.0, 1.0, 1.0]


def test_a_replay_after_a_crash_assigns_every_record_again_and_charges_the_restart(tmp_path):
    parts, _ = login_parts()
    ref = tmp_path / "ref"
    Aggregator(cfg_for(ref), ListSource(parts, chunk=50)).run()
    run = tmp_path / "run"
    agg = Aggregator(cfg_for(run), ListSource(parts, chunk=7))
    agg.restore()
    while agg.task.window.get("event_index") != 1 or agg.task.window["events"] < 100:
        for seg in agg.source.poll():
            agg._ingest(seg)
    del agg  # SIGKILL inside window 1: its bits were in memory, it is replayed into fresh ones
    Aggregator(cfg_for(run), ListSource(parts, ["t:1", "t:0"], chunk=100)).run()
    assert windows_of(docs(run)) == windows_of(docs(ref))
    entries = ledger(run)
    releases = {e["window"]: e for e in entries if e["kind"] == "release"}
    restarted = {e["window_uid"] for e in entries if e["kind"] == "restart"}
    assert restarted
    for e in releases.values():  # a replayed window is charged twice to every user
        assert e["user_epsilon"] == (2.0 if e["window_uid"] in restarted else 1.0)


def test_a_crash_while_two_windows_are_live_charges_both_replays(tmp_path):
    """With allowed lateness the second window counts while the first waits for late records.
    A kill -9 then loses both windows' bits; the restore replays the first from its checkpoint
    and the second's records with it, into fresh bits: each of the two windows is charged 2 eps
    to every user (the second by a restart entry of its own, written when it opens)."""
    parts, _ = login_parts()
    late = "window.allowed_lateness_s=4"
    ref = tmp_path / "ref"
    Aggregator(cfg_for(ref, late), ListSource(parts, chunk=50)).run()
    run = tmp_path / "run"
    agg = Aggregator(cfg_for(run, late), ListSource(parts, chunk=7))
    agg.restore()
    second = None
    while second is None or second.events < 50:
        for seg in agg.source.poll():
            agg._ingest(seg)
        second = agg.event_time.second
    live = (agg.task.window["id"], second.index)
    del agg  # SIGKILL with two live windows: both their bits were in memory
    Aggregator(cfg_for(run, late), ListSource(parts, ["t:1", "t:0"], chunk=100)).run()
    assert windows_of(docs(run)) == windows_of(docs(ref))
    entries = ledger(run)
    releases = [e for e in entries if e["kind"] == "release"]
    restarted = {e["window_uid"] for e in entries if e["kind"] == "restart"}
    by_id = {e["window"]: e for e in releases}
    first_id = live[0]
    for wid in (first_id, first_id + 1):  # the restored window and the second: 2 eps each
        assert by_id[wid]["window_uid"] in restarted
        assert by_id[wid]["user_epsilon"] == 2.0
    for e in releases:
        assert e["user_epsilon"] == (2.0 if e["window_uid"] in restarted else 1.0)


def test_event_time_rollups_release_spans_of_event_time(tmp_path):
    """window.rollups beside event-time windows: the span level's windows are event-time
    windows of the span's length, fed by the same records; both levels charge every user."""
    from aggregator.service.multi import MultiAggregator

    parts, _ = login_parts(4)
    cfg = cfg_for(tmp_path, "window.rollups=2x", f"state.rollup_expected_users={2 * USERS}")
    MultiAggregator(cfg, ListSource(parts, chunk=50)).run()
    levels = {}
    for level in ("base", "r2x"):
        got = [
            json.loads(p.read_text())
            for p in (tmp_path / "releases" / level).glob("release-*.json")
        ]
        levels[level] = sorted(
            (d["window_info"]["event_start_unix"], d["window_info"]["event_end_unix"], d["n"])
            for d in got
        )
    assert levels["base"] == [(10 * w, 10 * w + 10, 3 * USERS) for w in range(4)]
    assert levels["r2x"] == [(0, 20, 6 * USERS), (20, 40, 6 * USERS)]
    charged = sum(
        float(json.loads(x).get("user_epsilon") or 0)
        for level in ("base", "r2x")
        for x in (tmp_path / "state" / level / "ledger.jsonl").read_text().splitlines()
    )
    assert charged == 6.0
