"""The shuffle-model analyzer (aggregator/service/analyzer.py) on records made directly with
shuffle_wire: no shuffler, no broker (tests/integration/test_shuffle_analyzer_kafka.py has the
broker, kill -9 and dead letters)."""

import errno
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from aggregator.anonymize import anonymized_histogram
from aggregator.service.analyzer import ShuffleAnalyzer, load_analyzer_key
from aggregator.service.config import load_config
from aggregator.service.process import ServiceError
from aggregator.service.shuffle_wire import (
    ParamTag,
    chunk_record,
    end_record,
    new_keypair,
    open_boxes,
    public_key_hex,
    seal_rows,
)
from aggregator.shuffle import (
    BalcerCheuRandomizer,
    GKMPRandomizer,
    balcer_cheu_analyze,
    gkmp_analyze,
)
from consumers.base import Segment, Source

PART = "analyzer:0"


class ListSource(Source):
    """Records of one partition handed out in order (``stop_after``: the source ends there, as a
    process that stopped would have seen it)."""

    def __init__(self, values, batch=7, stop_after=None):
        self.values, self.batch = list(values), batch
        self.end = len(self.values) if stop_after is None else stop_after
        self.pos = 0

    def seek(self, offsets):
        self.pos = int(offsets.get(PART, 0))

    def poll(self, timeout_s=1.0):
        if self.pos >= self.end:
            return []
        hi = min(self.end, self.pos + self.batch)
        seg = Segment(PART, range(self.pos, hi), self.values[self.pos : hi])
        self.pos = hi
        return [seg]

    @property
    def exhausted(self):
        return self.pos >= self.end


def config(tmp_path, *extra, eps=1.0, buckets=50, n=200):
    return load_config(
        None,
        [
            f"state.epsilon={eps}",
            f"state.domain_size={buckets}",
            f"window.size={n}",
            "state.model=shuffle",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "release.error_bar_reps=0",
            "release.estimator=threshold",
            "metrics.port=-1",
            *extra,
        ],
    )


def tag(eps=1.0, n=200, buckets=50, delta=1e-6, gamma=0.1, protocol="gkmp"):
    """The parameter fingerprint of clients at these settings (config()'s defaults)."""
    return ParamTag(
        {
            "protocol": protocol,
            "epsilon": eps,
            "delta": delta,
            "n": n,
            "buckets": buckets,
            "gamma": gamma,
        }
    )


def window_records(
    window,
    rows,
    key,
    *,
    chunk=300,
    events,
    topped_up=0,
    messages=None,
    params=None,
    rng=None,
    tag=None,
):
    """The shuffler's output for one window: permuted sealed rows in chunks, then the marker.
    ``tag``: the clients' parameters (default: config()'s defaults at ``events + topped_up``)."""
    rng = rng or np.random.default_rng(window)
    rows = rows[rng.permutation(len(rows))]
    boxes = seal_rows(rows, key.public_key, tag or globals()["tag"](n=events + topped_up))
    out = [chunk_record(window, boxes[i : i + chunk]) for i in range(0, len(boxes), chunk)]
    out.append(
        end_record(
            window, events, topped_up, len(boxes) if messages is None else messages, params=params
        )
    )
    return out


def gkmp_window(rz, items):
    rows, _ = rz.encode_many(items)
    return rows


def run(cfg, values, key, **kw):
    an = ShuffleAnalyzer(
        cfg,
        ListSource(values, **{k: v for k, v in kw.items() if k in ("batch", "stop_after")}),
        private_key=key,
    )
    an.run()
    return an


def releases(tmp_path):
    d = tmp_path / "releases"
    return (
        sorted(
            (json.loads(p.read_text()) for p in d.glob("release-*.json")), key=lambda r: r["window"]
        )
        if d.exists()
        else []
    )


def ledger(tmp_path):
    return [json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def key():
    return new_keypair()


def test_gkmp_window_released_with_the_analyzer_counts(tmp_path, key):
    cfg = config(tmp_path)
    rz = GKMPRandomizer(1.0, 1e-6, 200, 50)
    items = np.random.default_rng(1).zipf(1.6, 200) % 50
    rows = gkmp_window(rz, items)
    values = window_records(0, rows, key, events=200)
    an = run(cfg, values, key)
    # the counts the release was computed from: exactly gkmp_analyze of the decrypted messages
    boxes = [b for v in values[:-1] for b in __import__("msgpack").unpackb(v)["boxes"]]
    decrypted = open_boxes(boxes, key)
    assert np.array_equal(an.last_counts, gkmp_analyze(decrypted, 50))
    assert np.array_equal(an.last_counts, gkmp_analyze(rows, 50))
    (rel,) = releases(tmp_path)
    assert rel["model"] == "shuffle" and rel["protocol"] == "gkmp"
    assert rel["epsilon"] == 1.0 and rel["delta"] == 1e-6 and rel["delta_spent"] <= 1e-6
    assert rel["p"] == rz.p and rel["layers"] == 1 and rel["n"] == 200
    assert rel["window_info"]["messages"] == len(rows) and rel["window_info"]["topped_up"] == 0
    # issue 54: the window's bounds in the one scheme every service release has (ISO 8601 UTC)
    assert rel["window_start"].endswith("Z") and rel["window_start"] <= rel["window_end"]
    hist = anonymized_histogram(an.last_counts, rz.p, layers=1, n=200, method="threshold")
    vals, cnts = np.unique(hist[hist > 0], return_counts=True)
    assert sorted(rel["histogram"]["pairs"]) == [[int(r), int(c)] for r, c in zip(vals, cnts)]
    (entry,) = [e for e in ledger(tmp_path) if e["kind"] == "release"]
    assert entry["epsilon_spent"] == 1.0 and entry["delta_spent"] == rz.delta_spent < 1e-6
    assert entry["delta"] == 1e-6 and rel["delta_spent"] == rz.delta_spent
    assert entry["model"] == "shuffle" and json.loads(entry["document"]) == rel


def test_exact_histogram_at_large_epsilon_and_two_windows(tmp_path, key):
    """Noise-free rows at eps = 20: each release is exactly the true anonymized histogram."""
    cfg = config(tmp_path, eps=20.0, n=300)
    rng = np.random.default_rng(2)
    values, truth = [], []
    for w in range(2):
        items = rng.zipf(1.4, 300) % 50
        rows = np.column_stack([items, np.ones_like(items)]).astype(np.int64)
        values += window_records(w, rows, key, events=300, tag=tag(eps=20.0, n=300))
        truth.append(sorted(np.bincount(items)[np.bincount(items) > 0].tolist()))
    run(cfg, values, key)
    rels = releases(tmp_path)
    assert [r["window"] for r in rels] == [0, 1]
    for rel, t in zip(rels, truth):
        got = sorted(r for r, c in rel["histogram"]["pairs"] for _ in range(c))
        assert got == t


def test_restart_mid_window_resumes_from_the_checkpoint(tmp_path, key, monkeypatch):
    """A stop inside window 1 (partial sums checkpointed), then a new process: one release per
    window, and the same counts as an uninterrupted run."""
    import aggregator.service.analyzer as mod

    monkeypatch.setattr(mod, "PARTIAL_CHECKPOINT_S", 0.0)
    cfg = config(tmp_path, n=150)
    rz = GKMPRandomizer(1.0, 1e-6, 150, 50)
    rng = np.random.default_rng(3)
    rows = [gkmp_window(rz, rng.integers(0, 50, 150)) for _ in range(2)]
    values = window_records(0, rows[0], key, events=150, chunk=100) + window_records(
        1, rows[1], key, events=150, chunk=100
    )
    cut = len(values) - 3
    first = run(cfg, values, key, stop_after=cut, batch=3)
    assert first.window is not None and first.window["id"] == 1 and first.window["received"] > 0
    assert [r["window"] for r in releases(tmp_path)] == [0]  # never before its marker
    second = run(cfg, values, key, batch=5)
    assert [r["window"] for r in releases(tmp_path)] == [0, 1]
    assert np.array_equal(second.last_counts, gkmp_analyze(rows[1], 50))
    assert [e["window"] for e in ledger(tmp_path) if e["kind"] == "release"] == [0, 1]


def test_time_window_with_top_ups(tmp_path, key):
    cfg = config(tmp_path, "window.kind=time", "window.size=60", "shuffle.n=200")
    rz = GKMPRandomizer(1.0, 1e-6, 200, 50)
    real = gkmp_window(rz, np.random.default_rng(4).integers(0, 50, 120))
    rows = np.concatenate([real] + [rz.noise_only() for _ in range(80)])
    an = run(cfg, window_records(0, rows, key, events=120, topped_up=80), key)
    (rel,) = releases(tmp_path)
    assert rel["n"] == 120 and rel["window_info"]["topped_up"] == 80
    assert np.array_equal(an.last_counts, gkmp_analyze(rows, 50))


def test_refusals_one_error_line_each(tmp_path, key, caplog):
    cfg = config(tmp_path, n=100)
    rz = GKMPRandomizer(1.0, 1e-6, 100, 50)
    rows = gkmp_window(rz, np.arange(100) % 50)
    mine = tag(n=100)
    values = (
        window_records(0, rows, key, events=100, messages=len(rows) + 1)  # count off
        + window_records(1, rows, key, events=90, tag=mine)  # n off
        + window_records(2, rows, key, events=100, tag=tag(n=100, buckets=64))  # clients
        + window_records(3, rows, key, events=100)[:-1]  # no marker
        + window_records(
            4,
            rows,
            key,
            events=100,
            params={
                "protocol": "gkmp",
                "epsilon": 1,
                "delta": 1e-6,
                "n": 100,
                "buckets": 50,
                "gamma": 0.1,
            },
        )
        # the shuffler's marker names other parameters, every message carries the
        # analyzer's: released, with a warning
        + window_records(5, rows, key, events=100, params={"protocol": "gkmp", "buckets": 64})
    )
    with caplog.at_level(logging.WARNING, logger="panagg.analyzer"):
        run(cfg, values, key)
    assert [r["window"] for r in releases(tmp_path)] == [4, 5]
    refused = [e for e in ledger(tmp_path) if e["kind"] == "refused"]
    assert [e["window"] for e in refused] == [0, 1, 2, 3]
    assert [e["cause"] for e in refused] == ["count", "n", "buckets", "incomplete"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 4
    assert "end marker counts" in errors[0] and "randomizer outputs" in errors[1]
    assert "buckets 64 (analyzer: 50)" in errors[2] and "without its end marker" in errors[3]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "window 5" in warnings[0] and "end marker" in warnings[0]


def test_wrong_key_rejects_every_chunk_and_refuses(tmp_path, key, caplog):
    other = new_keypair()
    cfg = config(tmp_path, n=100)
    rz = GKMPRandomizer(1.0, 1e-6, 100, 50)
    values = window_records(0, gkmp_window(rz, np.arange(100) % 50), other, events=100)
    with caplog.at_level(logging.ERROR, logger="panagg.analyzer"):
        an = run(cfg, values, key)
    assert releases(tmp_path) == []
    assert an.totals["rejects"]["undecryptable"] == len(values) - 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no message decrypts" in errors[0]  # one line: the key
    assert public_key_hex(key) in errors[0] and "another public key" in errors[0]
    assert [e["cause"] for e in ledger(tmp_path) if e["kind"] == "refused"] == ["key"]


def test_malformed_and_stale_records_never_crash(tmp_path, key):
    cfg = config(tmp_path, n=100)
    rz = GKMPRandomizer(1.0, 1e-6, 100, 50)
    rows = gkmp_window(rz, np.arange(100) % 50)
    w0 = window_records(0, rows, key, events=100)
    bad = [
        b"\xc1 not msgpack",
        None,
        b"",
        __import__("msgpack").packb({"v": 2, "window": 0}),
        __import__("msgpack").packb({"v": 2, "window": 0, "boxes": [b"short"]}),
    ]
    values = w0[:1] + bad[:4] + w0[1:] + w0 + [bad[4]]  # window 0 again after its marker: stale
    an = run(cfg, values, key)
    assert [r["window"] for r in releases(tmp_path)] == [0]
    assert an.totals["rejects"]["malformed_record"] == 4
    assert an.totals["rejects"]["stale_window"] == len(w0) + 1


def test_more_buckets_at_the_clients_is_named_as_buckets_not_key(tmp_path, key, caplog):
    cfg = config(tmp_path, n=100, buckets=40)
    rz = GKMPRandomizer(1.0, 1e-6, 100, 50)
    with caplog.at_level(logging.ERROR, logger="panagg.analyzer"):
        an = run(
            cfg,
            window_records(
                0, gkmp_window(rz, np.arange(100) % 50), key, events=100, tag=ParamTag.of(rz)
            ),
            key,
        )
    assert releases(tmp_path) == [] and an.totals["rejects"]["other_parameters"] >= 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "buckets 50 (analyzer: 40)" in errors[0]
    assert "key" not in errors[0].replace("shuffle-recover", "")


def test_corrupt_rows_under_the_right_fingerprint(tmp_path, key, caplog):
    cfg = config(tmp_path, n=100, buckets=40)
    rows = np.array([[45, 1]] * 30 + [[3, 1]] * 100, np.int64)  # bucket 45 >= 40
    with caplog.at_level(logging.ERROR, logger="panagg.analyzer"):
        an = run(
            cfg,
            window_records(0, rows, key, events=100, tag=tag(n=100, buckets=40), chunk=1000),
            key,
        )
    assert releases(tmp_path) == [] and an.totals["rejects"]["bucket_out_of_range"] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "outside [0, 40)" in errors[0]


def test_balcer_cheu_window(tmp_path, key):
    n, b = 1600, 8
    cfg = config(tmp_path, "shuffle.protocol=balcer-cheu", eps=2.0, buckets=b, n=n)
    rz = BalcerCheuRandomizer(2.0, 1e-6, n, b)
    items = np.random.default_rng(5).zipf(1.3, n) % b
    rows = np.concatenate([rz.encode(int(x)) for x in items])
    an = run(cfg, window_records(0, rows, key, events=n, chunk=2000, tag=ParamTag.of(rz)), key)
    est = balcer_cheu_analyze(rows, b, rz)
    assert np.array_equal(an.last_counts, est)
    (rel,) = releases(tmp_path)
    assert rel["protocol"] == "balcer-cheu" and rel["model"] == "shuffle" and rel["p"] is None
    rounded = np.rint(est).astype(int)
    want = sorted(rounded[rounded > 0].tolist())
    assert sorted(r for r, c in rel["histogram"]["pairs"] for _ in range(c)) == want
    assert rel["shuffle"]["s"] == rz.s and "signal_below_noise" not in rel


def test_key_from_file_or_environment(tmp_path, key):
    cfg = config(tmp_path)
    with pytest.raises(ServiceError, match="shuffle-keygen --out FILE"):
        load_analyzer_key(cfg, env={})
    with pytest.raises(ServiceError, match="64 hex digits"):
        load_analyzer_key(cfg, env={"PANAGG_SHUFFLE_PRIVATE_KEY": "zz"})
    assert bytes(
        load_analyzer_key(cfg, env={"PANAGG_SHUFFLE_PRIVATE_KEY": bytes(key).hex()})
    ) == bytes(key)
    missing = config(tmp_path, f"shuffle.key_file={tmp_path / 'nope'}")
    with pytest.raises(ServiceError, match="shuffle-keygen"):
        load_analyzer_key(missing, env={})


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
    )


def test_keygen_writes_0600_and_refuses_to_overwrite(tmp_path):
    out = tmp_path / "analyzer.key"
    res = cli("shuffle-keygen", "--out", str(out))
    assert res.returncode == 0, res.stderr
    pub = res.stdout.strip()
    assert len(pub) == 64 and stat.S_IMODE(out.stat().st_mode) == 0o600
    from aggregator.service.shuffle_wire import load_private_key

    assert public_key_hex(load_private_key(str(out))) == pub
    again = cli("shuffle-keygen", "--out", str(out))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    # a directory that is not there: one line naming it, nothing written (not a temp name)
    missing = cli("shuffle-keygen", "--out", str(tmp_path / "keys" / "analyzer.key"))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.strip() == (
        f"panagg: error: the directory {tmp_path / 'keys'} for --out does not exist: create it "
        "first (readable by the analyzer's user only), then run shuffle-keygen again"
    )
    assert not (tmp_path / "keys").exists()


def test_run_without_key_is_one_line(tmp_path):
    res = cli(
        "run",
        "--set",
        "state.model=shuffle",
        "--set",
        "window.size=100",
        "--state-dir",
        str(tmp_path / "s"),
        env={"PANAGG_SHUFFLE_PRIVATE_KEY": ""},
    )
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [res.stderr.strip()]
    assert "shuffle-keygen" in res.stderr and "shuffle.key_file" in res.stderr


def test_config_checks(tmp_path):
    from aggregator.service.config import ConfigError

    with pytest.raises(ConfigError, match="needs shuffle.n"):
        config(tmp_path, "window.kind=time", "window.size=60")
    with pytest.raises(ConfigError, match="differs from window.size"):
        config(tmp_path, "shuffle.n=10")
    with pytest.raises(ConfigError, match="scale.partitioned"):
        config(tmp_path, "scale.partitioned=true")
    with pytest.raises(ConfigError, match="shuffle.protocol"):
        config(tmp_path, "shuffle.protocol=rappor")


def test_too_many_messages_refused_at_start(tmp_path, key):
    cfg = config(tmp_path, buckets=10**7, n=10)
    with pytest.raises(ServiceError, match="messages per event"):
        ShuffleAnalyzer(cfg, ListSource([]), private_key=key)


def test_other_epsilon_refused_then_recovered_once(tmp_path, key, caplog):
    """Clients at eps 2 against an analyzer at eps 1: refused (one line, both sides), nothing
    published; recovery under eps 2 releases it once, the ledger charging eps 2 and the exact
    delta; a second recovery re-publishes the ledgered document."""
    theirs = GKMPRandomizer(2.0, 1e-6, 100, 50)
    rows = gkmp_window(theirs, np.arange(100) % 50)
    values = window_records(0, rows, key, events=100, tag=ParamTag.of(theirs))
    with caplog.at_level(logging.ERROR, logger="panagg.analyzer"):
        run(config(tmp_path, n=100), values, key)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "epsilon 2 (analyzer: 1)" in errors[0]
    assert (
        "[clients: protocol gkmp, epsilon 2, delta 1e-06, n 100, buckets 50, gamma 0.1]"
        in errors[0]
    )
    assert releases(tmp_path) == []

    def records(partition, start, end):
        assert partition == PART
        return [(i, values[i]) for i in range(start, end)]

    # the unfixed analyzer: still refused, nothing ledgered as a release
    same = ShuffleAnalyzer(config(tmp_path, n=100), None, private_key=key)
    assert [o for _, _, o in same.recover([0], records)] == ["still refused (parameters)"]
    assert releases(tmp_path) == []
    fixed = ShuffleAnalyzer(config(tmp_path, n=100, eps=2.0), None, private_key=key)
    assert [o for _, _, o in fixed.recover([0], records)] == ["released"]
    (rel,) = releases(tmp_path)
    assert rel["epsilon"] == 2.0 and rel["delta_spent"] == theirs.delta_spent
    (entry,) = [e for e in ledger(tmp_path) if e["kind"] == "release"]
    assert entry["epsilon_spent"] == 2.0 and entry["delta_spent"] == theirs.delta_spent
    assert entry["recovered_from"].startswith("refused-")
    assert np.array_equal(fixed.last_counts, gkmp_analyze(rows, 50))
    again = ShuffleAnalyzer(config(tmp_path, n=100, eps=2.0), None, private_key=key)
    assert [o for _, _, o in again.recover(None, records)] == ["re-published"]
    assert len(releases(tmp_path)) == 1
    assert len([e for e in ledger(tmp_path) if e["kind"] == "release"]) == 1
    # a window that is not refused: nothing to do
    assert [o for _, _, o in again.recover([7], records)] == ["not refused"]


def test_recovery_from_dead_letters_when_retention_took_the_window(tmp_path, key):
    """The analyzer topic no longer holds the window: its chunks come from the dead letters
    (every chunk of a refused window was dead-lettered), its marker's counts from the ledger."""
    theirs = GKMPRandomizer(1.0, 1e-6, 100, 30)
    values = window_records(
        0, gkmp_window(theirs, np.arange(100) % 30), key, events=100, tag=ParamTag.of(theirs)
    )
    run(config(tmp_path, n=100), values, key)
    (refused,) = [e for e in ledger(tmp_path) if e["kind"] == "refused"]
    assert refused["cause"] == "buckets" and refused["marker"]["events"] == 100

    def records(partition, start, end, dead_letters=False):
        # the topic is empty now; the dead letters hold every chunk (not the marker)
        return [(i, values[i]) for i in range(start, end - 1)] if dead_letters else []

    fixed = ShuffleAnalyzer(config(tmp_path, n=100, buckets=30), None, private_key=key)
    assert [o for _, _, o in fixed.recover(None, records)] == ["released"]
    (rel,) = releases(tmp_path)
    assert rel["domain"]["size"] == 30 and rel["n"] == 100

    def gone(partition, start, end, dead_letters=False):
        return []

    other = tmp_path / "again"
    run(config(other, n=100), values, key)
    lost = ShuffleAnalyzer(config(other, n=100, buckets=30), None, private_key=key)
    assert [o for _, _, o in lost.recover(None, gone)] == ["records gone"]


def test_a_checkpoint_that_cannot_be_written_is_seen_and_waited_for(tmp_path, key, monkeypatch):
    """The disk under the analyzer's checkpoints fills (ENOSPC): the analyzer does not skip the
    write; it waits, says so at once (``/ready`` 503 naming the checkpoint,
    ``panagg_write_failing{what="checkpoint"}`` 1), goes on when the disk has room again and
    releases the window; a stop while it waits ends the run (nothing written after it)."""
    from aggregator.service.metrics import Metrics
    from state_store.local import LocalStore

    full = threading.Event()
    full.set()
    real_save = LocalStore.save

    def save(self, record):
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, record)

    monkeypatch.setattr(LocalStore, "save", save)
    rz = GKMPRandomizer(1.0, 1e-6, 200, 50)
    values = window_records(0, gkmp_window(rz, np.arange(200) % 50), key, events=200)
    metrics = Metrics()
    an = ShuffleAnalyzer(config(tmp_path), ListSource(values), private_key=key, metrics=metrics)
    failing = metrics.write_failing.labels(what="checkpoint")
    runner = threading.Thread(target=an.run)
    runner.start()
    deadline = time.monotonic() + 30
    while failing._value.get() != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    status, reason = metrics.readiness()
    assert failing._value.get() == 1, "the failing checkpoint was not reported"
    assert status == 503 and "checkpoint cannot be written (No space left on device" in reason
    assert runner.is_alive() and not releases(tmp_path)  # waiting, not skipping the write
    full.clear()
    runner.join(60)
    assert not runner.is_alive()
    assert failing._value.get() == 0 and metrics.readiness()[0] == 200
    (rel,) = releases(tmp_path)
    assert rel["n"] == 200

    # a stop request while the write fails ends the wait: the run returns
    full.set()
    again = tmp_path / "again"
    stopped = ShuffleAnalyzer(config(again), ListSource(values), private_key=key, metrics=Metrics())
    runner = threading.Thread(target=stopped.run)
    runner.start()
    deadline = time.monotonic() + 30
    while not (again / "state").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)
    stopped.stop_event.set()
    runner.join(30)
    assert not runner.is_alive(), "a stop request did not end the wait for the checkpoint"
    assert not releases(again)
