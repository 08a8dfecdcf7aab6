"""Releases beside the loop (aggregator.service.release_worker): intake goes on while a release
runs, every window's release is exact and published once in window order, a kill -9 with closed
windows waiting for their release replays and releases each exactly once, and the ledger's
charges stay per event. (Several aggregations still release in the loop: not tested here.)"""

import json
import time

import numpy as np
import pytest

from aggregator.service import Aggregator
from consumers.file_source import FileSource
from tests.helpers.service import (
    D,
    cfg_for,
    cli_sets,
    durable,
    expected_release,
    ledger_entries,
    run_cli,
    write_events,
)

DELAY = "1.5"


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def _releases(tmp_path):
    return {
        json.loads(p.read_text())["window"]: json.loads(p.read_text())
        for p in (tmp_path / "releases").glob("release-*.json")
    }


def _three_windows(tmp_path, seed):
    """(items, path, aggregator): 3,000 events in a file, windows of 1,000, a release worker,
    polls of 100 records."""
    items = np.random.default_rng(seed).integers(0, D, 3000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    cfg = cfg_for(
        tmp_path, path, **{"window.size": 1000, "release.workers": 1, "source.max_records": 100}
    )
    return items, path, Aggregator(cfg, FileSource(str(path), "json", batch=100, progress=False))


def test_intake_goes_on_while_a_release_runs_and_every_release_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("PANAGG_TEST_RELEASE_DELAY_S", DELAY)  # inherited by the worker
    items, path, agg = _three_windows(tmp_path, seed=31)
    counted_while_releasing = []
    count = agg.intake.count

    def probe(state, batch):  # how many windows wait for their release as events are counted
        counted_while_releasing.append((len(agg.task.inflight), len(batch)))
        return count(state, batch)

    agg.intake.count = probe
    agg.run()
    during = sum(n for waiting, n in counted_while_releasing if waiting)
    assert during >= 1000  # a whole window counted while the previous release ran
    docs = _releases(tmp_path)
    assert sorted(docs) == [0, 1, 2]
    for w in range(3):  # the worker's release of exactly the window's events
        assert docs[w]["n"] == 1000
        assert (
            docs[w]["histogram"]
            == expected_release(items[w * 1000 : (w + 1) * 1000], w)["histogram"]
        )
    releases = [e for e in ledger_entries(tmp_path) if e["kind"] == "release"]
    assert [e["window"] for e in releases] == [0, 1, 2]  # ledgered in window order
    assert [e["ranges"][f"file:{path.name}"] for e in releases] == [
        [0, 1000],
        [1000, 2000],
        [2000, 3000],
    ]
    ckpt = durable(tmp_path)
    assert ckpt.unreleased == [] and ckpt.pending == [] and ckpt.window["id"] == 3


def test_states_counted_in_their_shared_blocks_release_exactly(tmp_path, monkeypatch):
    """The service path of the zero-copy hand-off (issue 53): with every state housed in a
    shared block as it is drawn, each window is counted in its block, handed over by name (only
    window 0, drawn before the worker started, is copied at its close) and released exactly."""
    from aggregator.service import release_worker

    monkeypatch.setattr(release_worker, "HOUSE_MIN_SIZE", 1)
    copied = []
    shelve = release_worker._shelve
    monkeypatch.setattr(release_worker, "_shelve", lambda state: copied.append(1) or shelve(state))
    items, path, agg = _three_windows(tmp_path, seed=34)
    agg.run()
    docs = _releases(tmp_path)
    assert sorted(docs) == [0, 1, 2] and len(copied) == 1
    for w in range(3):
        assert docs[w]["n"] == 1000
        assert (
            docs[w]["histogram"]
            == expected_release(items[w * 1000 : (w + 1) * 1000], w)["histogram"]
        )


@pytest.mark.parametrize(
    "fault, replayed",
    [
        ("release-submitted:2", [0, 1]),  # windows 0 and 1 closed, neither released
        ("release-ledgered:1", [1]),  # window 0 ledgered, its checkpoint not yet written
    ],
)
def test_kill_with_closed_unreleased_windows_releases_each_once(tmp_path, fault, replayed):
    items = np.random.default_rng(32).integers(0, D, 3500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(
        tmp_path,
        path,
        **{"window.size": 1000, "release.on_exhausted": "false", "release.workers": 1},
    )
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault, "PANAGG_TEST_RELEASE_DELAY_S": DELAY})
    assert first.returncode == -9, first.stderr[-2000:]
    ckpt = durable(tmp_path)
    assert ckpt.unreleased and ckpt.unreleased[0]["window"]["id"] == 0
    second = run_cli(args)
    assert second.returncode == 0, second.stderr[-2000:]
    docs = _releases(tmp_path)
    assert sorted(docs) == [0, 1, 2]
    for w in range(3):  # exact n, the events of exactly its range, published once
        assert docs[w]["n"] == 1000
        assert (
            docs[w]["histogram"]
            == expected_release(items[w * 1000 : (w + 1) * 1000], w)["histogram"]
        )
    entries = ledger_entries(tmp_path)
    assert [e["window"] for e in entries if e["kind"] == "release"] == [0, 1, 2]
    restarted = [e for e in entries if e["kind"] == "restart"]
    assert restarted and restarted[0]["window"] == replayed[0]
    assert "replayed from the source and released once" in second.stderr
    ckpt = durable(tmp_path)
    assert ckpt.unreleased == [] and ckpt.window["id"] == 3 and ckpt.pending == []


def test_several_aggregations_release_in_parallel_and_exactly(tmp_path, monkeypatch):
    """Three aggregations of one stream, windows of 700 / 700 / 900 events, a release worker
    pool of 3 and releases made to take 1.5 s: the releases of different aggregations run at
    the same time (not one after another), and every window holds exactly its events."""
    from aggregator.service.multi import MultiAggregator
    from tests.helpers.multi import config, write_events

    monkeypatch.setenv("PANAGG_TEST_RELEASE_DELAY_S", "1.5")
    write_events(tmp_path / "events.jsonl", 2100, seed=3)
    cfg = config(tmp_path, "release.workers=3")
    multi = MultiAggregator(cfg, FileSource(cfg.source.path, fmt="json", batch=700))
    multi.run()
    runs = [
        (name, started, ended)
        for name, agg in multi.aggs.items()
        for _, started, ended in agg.release_runs
    ]
    assert len(runs) == 3 + 3 + 3  # (the last windows are released at the file's end)
    overlapping = [
        (a, b) for a in runs for b in runs if a[0] < b[0] and a[1] < b[2] and b[1] < a[2]
    ]
    assert overlapping, runs
    for name, size in (("account", 700), ("device", 700), ("ip", 900)):
        docs = sorted(
            (
                json.loads(p.read_text())
                for p in (tmp_path / "releases" / name).glob("release-*.json")
            ),
            key=lambda d: d["window"],
        )
        assert len(docs) == 3 and [d["n"] for d in docs][:-1] == [size, size], name
    assert sum(d["n"] for d in _releases_of(tmp_path, "account")) == 2100


def _releases_of(tmp_path, name):
    return [json.loads(p.read_text()) for p in (tmp_path / "releases" / name).glob("*.json")]


@pytest.mark.parametrize(
    "fault, restart",
    [
        ("release-submitted:2", "1 closed window(s)"),  # two closed windows in flight
        ("checkpoint-after-rename:2", "a layered snapshot"),  # right after window 0's snapshot
        ("checkpoint-after-rename:5", "2 closed window(s)"),
    ],
)
def test_snapshots_with_the_release_worker_stay_exact(tmp_path, fault, restart):
    """Layered snapshots inside windows (checkpoint.snapshots_per_window = 2) with releases
    beside the loop: a snapshot waits while a closed window is in flight, a kill with two
    closed windows in flight or right after a snapshot checkpoint, then a restart: every
    window released once with exactly its 1,000 events."""
    items = np.random.default_rng(33).integers(0, D, 3500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(
        tmp_path,
        path,
        **{
            "window.size": 1000,
            "release.on_exhausted": "false",
            "release.workers": 1,
            "checkpoint.snapshots_per_window": 2,
        },
    )
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault, "PANAGG_TEST_RELEASE_DELAY_S": DELAY})
    assert first.returncode == -9, first.stderr[-2000:]
    second = run_cli(args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert restart in second.stderr
    docs = _releases(tmp_path)
    assert sorted(docs) == [0, 1, 2]
    assert [docs[w]["n"] for w in range(3)] == [1000, 1000, 1000]
    entries = ledger_entries(tmp_path)
    releases = [e for e in entries if e["kind"] == "release"]
    assert [e["window"] for e in releases] == [0, 1, 2]
    ranges = [e["ranges"]["file:events.jsonl"] for e in releases]
    assert ranges == [[0, 1000], [1000, 2000], [2000, 3000]]


def _blocks() -> set:
    from pathlib import Path

    return {p.name for p in Path("/dev/shm").glob("psm_*")}


def test_the_hand_off_goes_through_shared_memory_freed_once_collected():
    """Issue 53: the closed counters reach the worker through a shared-memory block (not the
    pool's pipe, whose pickling held the loop's GIL); the release is the state's own, and the
    block is gone once the release is collected."""
    from aggregator.release import make_release
    from aggregator.service.release_worker import ReleaseWorker
    from aggregator.state import PanPrivateHistogram

    state = PanPrivateHistogram(1.0, size=4000)
    state.add_indices(np.random.default_rng(3).integers(0, 40, 5000))
    worker = ReleaseWorker(1)
    try:
        future = worker.submit(
            state,
            model="joint",
            loss="l1",
            window=0,
            rng=np.random.default_rng(5),
            error_bar_reps=0,
            method="threshold",
        )
        during = {block.name.lstrip("/") for block in worker._blocks}
        assert len(during) == 1 and during <= _blocks()  # the block, while the release runs
        doc = future.result(timeout=300)[0]
        deadline = time.monotonic() + 10  # (freed by the future's done callback)
        while during & _blocks() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.close()
    assert not (during & _blocks())
    here = make_release(
        state,
        model="joint",
        loss="l1",
        window=0,
        rng=np.random.default_rng(5),
        error_bar_reps=0,
        method="threshold",
    )
    assert doc["histogram"] == here["histogram"] and doc["n"] == here["n"] == 5000


def test_a_housed_state_is_handed_over_without_a_copy_and_its_block_freed():
    """Issue 53: a state drawn into a block of its own (``house``, beside the loop) goes to the
    worker by that block's name (no new block, nothing copied at the close); the release is the
    state's own; the block is unlinked once collected, and a housed state dropped unused takes
    its block with it."""
    import gc

    from aggregator.release import make_release
    from aggregator.service.release_worker import HOUSE_MIN_SIZE, ReleaseWorker
    from aggregator.state import PanPrivateHistogram

    def housed_names() -> set:
        return {block.name.lstrip("/") for block in worker._housed.values()}

    worker = ReleaseWorker(1)
    try:
        state = worker.house(PanPrivateHistogram(1.0, size=HOUSE_MIN_SIZE))
        housed = housed_names()
        assert len(housed) == 1 and housed <= _blocks()
        state.add_indices(np.random.default_rng(3).integers(0, 40, 5000))  # counted in place
        expected = make_release(
            state,
            model="joint",
            loss="l1",
            window=0,
            rng=np.random.default_rng(5),
            error_bar_reps=0,
            method="threshold",
        )
        future = worker.submit(
            state,
            model="joint",
            loss="l1",
            window=0,
            rng=np.random.default_rng(5),
            error_bar_reps=0,
            method="threshold",
        )
        # the same block changed hands, no copy into a new one
        assert not worker._housed and {b.name.lstrip("/") for b in worker._blocks} == housed
        del state
        doc = future.result(timeout=300)[0]
        assert doc["histogram"] == expected["histogram"] and doc["n"] == 5000
        deadline = time.monotonic() + 10
        while housed & _blocks() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (housed & _blocks())

        dropped = worker.house(PanPrivateHistogram(1.0, size=HOUSE_MIN_SIZE))
        unused = housed_names()
        assert len(unused) == 1 and unused <= _blocks()
        del dropped
        gc.collect()
        assert not (unused & _blocks()) and not worker._housed
        small = worker.house(PanPrivateHistogram(1.0, size=100))  # below the size: as it was
        assert not worker._housed and small.size == 100
    finally:
        worker.close()


def test_no_room_in_dev_shm_falls_back_to_the_pipe_with_one_warning(monkeypatch, caplog):
    """A /dev/shm too small for a block (containers cap it at 64 MiB) must not kill the service
    with SIGBUS: the block's pages are reserved up front, and without room the closed state goes
    through the pool's pipe, with one WARNING naming the fix."""
    import errno
    import logging
    import os
    from multiprocessing import shared_memory

    from aggregator.release import make_release
    from aggregator.service.release_worker import HOUSE_MIN_SIZE, ReleaseWorker
    from aggregator.state import PanPrivateHistogram

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    made = []
    real = shared_memory.SharedMemory

    def tracked(*args, **kwargs):
        block = real(*args, **kwargs)
        made.append(block.name.lstrip("/"))
        return block

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(shared_memory, "SharedMemory", tracked)
    worker = ReleaseWorker(1)
    try:
        with caplog.at_level(logging.WARNING, logger="panagg.service"):
            state = worker.house(PanPrivateHistogram(1.0, size=HOUSE_MIN_SIZE))
            state.add_indices(np.arange(100))
            futures = [
                worker.submit(
                    state,
                    model="joint",
                    loss="l1",
                    window=w,
                    rng=np.random.default_rng(5),
                    error_bar_reps=0,
                    method="threshold",
                )
                for w in range(2)
            ]
            docs = [f.result(timeout=300)[0] for f in futures]
    finally:
        worker.close()
    assert made and not (set(made) & _blocks())  # each block tried was given up at once
    assert not worker._housed and not worker._blocks
    warned = [r.getMessage() for r in caplog.records if "/dev/shm" in r.getMessage()]
    assert len(warned) == 1 and "larger /dev/shm" in warned[0]
    expected = make_release(
        state,
        model="joint",
        loss="l1",
        window=0,
        rng=np.random.default_rng(5),
        error_bar_reps=0,
        method="threshold",
    )
    assert docs[0]["histogram"] == expected["histogram"] and docs[0]["n"] == 100


def test_a_block_in_flight_is_unlinked_when_the_service_is_killed(tmp_path):
    """A kill -9 while a release runs leaves no block behind: the pool's resource tracker, which
    outlives the killed process, unlinks it."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "hold.py"
    script.write_text(
        "import sys, time\n"
        "from aggregator.service.release_worker import ReleaseWorker\n"
        "from aggregator.state import PanPrivateHistogram\n"
        "w = ReleaseWorker(1)\n"
        "w.submit(PanPrivateHistogram(1.0, size=1000), model='joint', loss='l1', window=0,\n"
        "         rng=None, error_bar_reps=0, method=None)\n"
        "print(next(iter(w._blocks)).name, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, PANAGG_TESTING="1", PANAGG_TEST_RELEASE_DELAY_S="600")
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env
    )
    name = proc.stdout.readline().strip().lstrip("/")
    assert name and name in _blocks()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while name in _blocks() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert name not in _blocks()


def test_the_longest_intake_stall_of_a_window_is_exported(tmp_path):
    """panagg_intake_stall_seconds: the longest time between two polls in the last closed
    window. A count that takes 0.4 s in window 1 is its stall; window 0's is smaller."""
    _, _, agg = _three_windows(tmp_path, seed=33)
    count, stalls = agg.intake.count, {}
    close = agg.close_window

    def slow_in_window_1(state, batch):
        if agg.task.window["id"] == 1 and agg.task.window["events"] == 500:
            time.sleep(0.4)
        return count(state, batch)

    def closing():
        wid = agg.task.window["id"]
        out = close()
        stalls[wid] = agg.metrics.intake_stall._value.get()
        return out

    agg.intake.count, agg.close_window = slow_in_window_1, closing
    agg.run()
    assert stalls[1] >= 0.4 > stalls[0]
