"""The privacy ledger as the authority on events, not windows (docs/privacy.md, section 16).

Every release records the source positions it covers; an event's charge is the sum over the
releases whose ranges hold its position. A crash anywhere in a window's close, a fresh start, an
aggregation renamed under --accept-change, an empty window, a ledger deleted, truncated, rolled
back or edited, and a whole state directory restored from a backup: each either keeps every event
within its budget or is refused with one line, writing nothing.
"""

import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from aggregator.service import Aggregator
from aggregator.service.charges import ChargeBook
from aggregator.service.config import load_config
from aggregator.service.ledger import Ledger, LedgerError
from consumers.base import Source
from state_store.local import LocalStore

from tests.helpers.service import (
    D,
    SEED,
    charge_by_position,
    cli_sets,
    durable,
    expected_release,
    expected_state,
    ledger_entries,
    live_counts_via_export,
    run_cli,
    write_events,
)


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def _run(tmp_path, n=3500, size=1000, **sets):
    items = np.random.default_rng(25).integers(0, D, n)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(
        tmp_path, path, **{"window.size": size, "release.on_exhausted": "false", **sets}
    )
    return items, path, args


def _releases_of(tmp_path):
    return [e for e in ledger_entries(tmp_path) if e["kind"] == "release"]


def _snapshot(root: Path) -> dict:
    """Every file under ``root`` with its bytes (what a refused start must leave as it was)."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "service.lock"
    }  # the lock holds the pid of the try


# -- the chain -------------------------------------------------------------------------------


def test_entries_are_chained_and_an_edit_anywhere_is_found(tmp_path):
    path = tmp_path / "ledger.jsonl"
    led = Ledger(path, budget_per_window=1.0)
    for w in range(3):
        led.append(entry_id=f"release-{w}", kind="release", window=w, epsilon_spent=1.0)
    entries = [json.loads(x) for x in path.read_text().splitlines()]
    assert [e["seq"] for e in entries] == [1, 2, 3]
    assert entries[1]["prev"] == entries[0]["hash"] and entries[2]["prev"] == entries[1]["hash"]
    assert led.head() == {"seq": 3, "hash": entries[2]["hash"]}
    lines = path.read_text().splitlines()
    edited = json.loads(lines[0])
    edited["kind"] = "export"  # other valid JSON: window 0 would no longer count as released
    for damage, fragment in [
        ([json.dumps(edited, sort_keys=True)] + lines[1:], "line 1 does not match its hash"),
        (lines[:1] + lines[2:], "line 2 has seq 3 where 2 belongs"),
        ([lines[1], lines[0], lines[2]], "line 1 has seq 2 where 1 belongs"),
    ]:
        path.write_text("\n".join(damage) + "\n")
        with pytest.raises(LedgerError, match=fragment):
            Ledger(path, budget_per_window=1.0)


def test_format_1_ledgers_are_refused_with_the_migration_and_migrate_keeps_the_charges(tmp_path):
    path = tmp_path / "ledger.jsonl"
    old = [
        {
            "id": "identity-1",
            "kind": "identity",
            "window": None,
            "epsilon_spent": 0.0,
            "time_unix": 1.0,
            "identity": {"stream": "file:e"},
        },
        {
            "id": "release-a",
            "kind": "release",
            "window": 0,
            "epsilon_spent": 1.0,
            "time_unix": 2.0,
            "end_offsets": {"file:e": 100},
        },
        {
            "id": "release-b",
            "kind": "release",
            "window": 1,
            "epsilon_spent": 1.0,
            "time_unix": 3.0,
            "end_offsets": {"file:e": 250},
        },
    ]
    path.write_text("".join(json.dumps(e) + "\n" for e in old))
    with pytest.raises(LedgerError, match=r"format 1 .*panagg ledger migrate --state-dir"):
        Ledger(path, budget_per_window=1.0)
    res = run_cli(["ledger", "migrate", "--state-dir", str(tmp_path)])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "ledger.jsonl.v1").read_text() == "".join(json.dumps(e) + "\n" for e in old)
    led = Ledger(path, budget_per_window=1.0)
    assert [e["ranges"] for e in led.releases()] == [{"file:e": [0, 100]}, {"file:e": [100, 250]}]
    assert led.charges().resume_offsets(1.0, budget=1.0) == {"file:e": 250}
    again = run_cli(["ledger", "migrate", "--state-dir", str(tmp_path)])
    assert again.returncode == 2 and "exists already" in again.stderr


def test_charge_book_sums_across_lineages_and_takes_the_max_within_event_time_windows():
    def rel(lineage, kind, lo, hi, eps=1.0):
        return {
            "kind": "release",
            "epsilon_spent": eps,
            "lineage": lineage,
            "window_kind": kind,
            "ranges": {"p": [lo, hi]},
        }

    # two event-time windows of one lineage overlap in positions but split the records
    book = ChargeBook([rel("a", "event_time", 0, 120), rel("a", "event_time", 100, 200)])
    assert book.peak({"p": [150, 250]}, 1.0, lineage="a", window_kind="event_time") == 1.0
    assert book.peak({"p": [150, 250]}, 1.0, lineage="b", window_kind="event_time") == 2.0
    # count windows never overlap within a lineage: an overlap adds up
    book = ChargeBook([rel("a", "count", 0, 100)])
    assert book.peak({"p": [50, 150]}, 1.0, lineage="a", window_kind="count") == 2.0
    assert book.peak({"p": [100, 150]}, 1.0, lineage="a", window_kind="count") == 1.0
    # an empty window charges nothing, a refusal neither
    book = ChargeBook(
        [rel("a", "count", 0, 100, eps=0.0), dict(rel("a", "count", 0, 100), kind="refused")]
    )
    assert book.peak({"p": [0, 100]}, 1.0) == 1.0 and book.resume_offsets(1.0, budget=1.0) == {}


# -- a crash at every step of a window's close -----------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        "ledger-after-release:1",  # the release is ledgered, the next window's checkpoint is not
        "checkpoint-mid-write:2",  # inside that checkpoint
        "checkpoint-after-rename:2",  # the checkpoint is durable, nothing published
        "published:1",  # published, the shorter pending list not yet durable
    ],
)
def test_a_crash_anywhere_in_the_close_publishes_once_and_never_replays_a_ledgered_window(
    tmp_path, fault
):
    items, path, args = _run(tmp_path, n=2500, size=2000)
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault})
    assert first.returncode == -9, first.stderr
    (entry,) = _releases_of(tmp_path)
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    published = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert published == json.loads(entry["document"])  # the ledgered document, once
    assert published["histogram"] == expected_release(items[:2000], 0)["histogram"]
    entries = ledger_entries(tmp_path)
    assert [e["window"] for e in entries if e["kind"] == "release"] == [0]
    # window 0 was not counted again: no restart replayed it (a replay would hold its events
    # in memory under fresh noise beside the published release of the old noise)
    assert not [e for e in entries if e["kind"] == "restart" and e["window"] == 0]
    assert entry["ranges"] == {f"file:{path.name}": [0, 2000]}
    counts, _, _ = live_counts_via_export(tmp_path)  # window 1 starts where window 0 ended
    assert np.array_equal(counts, expected_state(items[2000:], 1).counts)
    assert durable(tmp_path).pending == []


# -- fresh starts and changed aggregation sets -----------------------------------------------


def test_fresh_start_never_releases_an_event_twice(tmp_path):
    items, path, args = _run(tmp_path, n=3500)
    assert run_cli(args).returncode == 0  # windows 0-2 released, 500 events open
    shutil.rmtree(tmp_path / "state" / "checkpoints")
    with open(path, "a") as f:  # more input arrives meanwhile
        more = np.random.default_rng(26).integers(0, D, 1500)
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in more))
    res = run_cli(args + ["--fresh-start"])
    assert res.returncode == 0, res.stderr
    releases = _releases_of(tmp_path)
    part = f"file:{path.name}"
    assert [e["ranges"][part] for e in releases] == [
        [0, 1000],
        [1000, 2000],
        [2000, 3000],
        [3000, 4000],
        [4000, 5000],
    ]
    assert [e["window"] for e in releases] == [0, 1, 2, 3, 4]
    covered = np.zeros(5000, dtype=int)
    for e in releases:
        lo, hi = e["ranges"][part]
        covered[lo:hi] += 1
    assert covered.max() == 1  # each event in one release


def _multi_sets(tmp_path, path, names):
    sets = [
        "source.kind=file",
        f"source.path={path}",
        "source.format=json",
        "source.max_records=500",
        "window.kind=count",
        "window.size=1000",
        f"checkpoint.dir={tmp_path / 'state'}",
        f"release.dir={tmp_path / 'releases'}",
        "metrics.port=-1",
        f"testing.noise_seed={SEED}",
        "release.on_exhausted=false",
        "ledger.budget_per_event=1.5",
    ]
    eps = {"a": 1.0, "b": 0.5, "c": 1.0}
    for name in names:
        sets += [
            f"aggregations.{name}.item.field=item",
            f"aggregations.{name}.state.domain_size={D}",
            f"aggregations.{name}.state.epsilon={eps[name]}",
        ]
    out = ["run"]
    for s in sets:
        out += ["--set", s]
    return out


def test_renaming_an_aggregation_never_puts_an_event_over_budget_per_event(tmp_path):
    items, path, _ = _run(tmp_path, n=2500)
    assert run_cli(_multi_sets(tmp_path, path, ["a", "b"])).returncode == 0
    # a (eps 1) renamed to c (eps 1): with b at 0.5, c may not count what a released (2.5 > 1.5)
    res = run_cli(_multi_sets(tmp_path, path, ["c", "b"]) + ["--accept-change"])
    assert res.returncode == 0, res.stderr
    charge = charge_by_position(tmp_path / "state", f"file:{path.name}", 2500)
    assert charge.max() <= 1.5
    fresh = [
        json.loads(x) for x in (tmp_path / "state" / "c" / "ledger.jsonl").read_text().splitlines()
    ]
    ckpt = LocalStore(tmp_path / "state" / "c" / "checkpoints").load_latest()
    # c starts after a's last release, at 2000 (its open window holds the 500 events after it)
    assert ckpt.offsets == ckpt.window["start_offsets"] == {f"file:{path.name}": 2000}
    assert not [e for e in fresh if e["kind"] == "release"]


# -- empty windows ---------------------------------------------------------------------------


class _IdleStream(Source):
    """An endless source on which nothing arrives (a quiet topic)."""

    def poll(self, timeout_s: float = 1.0):
        time.sleep(min(timeout_s, 0.05))
        return []


def test_an_idle_time_window_run_keeps_its_budget(tmp_path, caplog):
    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            "source.topic=quiet",
            "window.kind=time",
            "window.clock=process",
            "window.size=1",
            f"state.domain_size={D}",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "ledger.budget_total=2",
            "release.error_bar_reps=0",
        ],
    )
    agg = Aggregator(cfg, _IdleStream())
    published = tmp_path / "releases"

    def stop_after_three_windows():  # (not a fixed time: a loaded machine starts slower)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not agg.stop_event.is_set():
            if len(list(published.glob("release-*.json"))) >= 3:
                break
            time.sleep(0.1)
        agg.stop_event.set()

    stopper = threading.Thread(target=stop_after_three_windows, daemon=True)
    stopper.start()
    try:
        agg.run()
    finally:
        agg.stop_event.set()
        stopper.join()
    releases = agg.ledger.releases()
    assert len(releases) >= 3  # more windows than budget_total pays for at eps 1 each
    assert all(e["epsilon_spent"] == 0.0 and e["n"] == 0 for e in releases)
    assert agg.ledger.spent() == 0.0 and agg.ledger.remaining() == 2.0
    assert agg.health.budget_exhausted() is None
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


# -- a ledger older than its anchors ---------------------------------------------------------


def _ledger_path(tmp_path):
    return tmp_path / "state" / "ledger.jsonl"


def _drop_last_line(p):
    lines = p.read_bytes().splitlines(keepends=True)
    p.write_bytes(b"".join(lines[:-1]))


@pytest.mark.parametrize(
    "case", ["deleted", "older copy", "last line dropped", "last bytes cut", "line edited"]
)
def test_a_lost_rolled_back_or_edited_ledger_is_refused_and_nothing_is_written(tmp_path, case):
    items, path, args = _run(tmp_path, n=2500)
    assert run_cli(args).returncode == 0  # windows 0-1 released, window 2 open
    ledger = _ledger_path(tmp_path)
    after_two = ledger.read_bytes()
    with open(path, "a") as f:
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in items[:1500]))
    assert run_cli(args).returncode == 0  # windows 2-3 released
    if case == "deleted":
        ledger.unlink()
    elif case == "older copy":
        ledger.write_bytes(after_two)
    elif case == "last line dropped":
        _drop_last_line(ledger)
    elif case == "last bytes cut":
        ledger.write_bytes(ledger.read_bytes()[:-37])
    else:
        lines = ledger.read_text().splitlines()
        first_release = next(i for i, x in enumerate(lines) if '"kind": "release"' in x)
        entry = json.loads(lines[first_release])
        entry["kind"] = "export"
        lines[first_release] = json.dumps(entry, sort_keys=True)
        ledger.write_text("\n".join(lines) + "\n")
    before = _snapshot(tmp_path)
    res = run_cli(args)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("panagg: error: ")
    assert [x for x in res.stderr.splitlines() if " ERROR " in x or "error:" in x] == [line]
    want = {
        "deleted": "is missing, but it had",
        "older copy": "truncated or rolled back",
        "last line dropped": "truncated or rolled back",
        "last bytes cut": "(its torn last line was complete)",
        "line edited": "does not match its hash",
    }[case]
    assert want in line, line
    assert _snapshot(tmp_path) == before  # a refused start writes nothing


def test_a_state_directory_restored_from_an_older_backup_is_refused(tmp_path):
    items, path, args = _run(tmp_path, n=2500)
    assert run_cli(args).returncode == 0  # windows 0-1 released
    backup = tmp_path / "backup"
    shutil.copytree(tmp_path / "state", backup)
    with open(path, "a") as f:
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in items[:1500]))
    assert run_cli(args).returncode == 0  # windows 2-3 released
    shutil.rmtree(tmp_path / "state")
    shutil.copytree(backup, tmp_path / "state")  # checkpoint and ledger agree, both old
    before = _snapshot(tmp_path)
    res = run_cli(args)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "truncated or rolled back" in line and ".panagg-ledger-head-" in line, line
    assert _snapshot(tmp_path) == before
    assert sorted(p.name for p in (tmp_path / "releases").glob("*.json")) == [
        f"release-{w}.json" for w in range(4)
    ]
