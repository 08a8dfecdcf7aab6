"""The shuffler's pure parts (no Kafka): record checks, dedupe, closing at n, top-up, the
permutation (exactly uniform), the state file's reconciliation with Kafka's committed offsets,
and the clients' item -> bucket maps."""

import itertools
import math
import os
from collections import Counter

import msgpack
import numpy as np
import pytest
from scipy.stats import chisquare

from aggregator.hashing import bucket_of
from aggregator.service.config import load_config
from aggregator.service.shuffle_client import ShuffleClient, bucket_map
from aggregator.service.shuffle_wire import (
    SEALED_SIZE,
    client_record,
    new_keypair,
    open_boxes,
    public_key_hex,
)
from aggregator.service.shuffler import (
    RECENT_WINDOWS,
    Shuffler,
    ShufflerError,
    Window,
    check_record,
    make_randomizer,
    permute,
)
from aggregator.shuffle import GKMPRandomizer

B, N = 30, 10


@pytest.fixture(scope="module")
def keys():
    return new_keypair()


def cfg_for(tmp_path, keys, *extra):
    sets = [
        "state.model=shuffle",
        "state.epsilon=4",
        f"state.domain_size={B}",
        f"window.size={N}",
        f"shuffle.public_key={public_key_hex(keys)}",
        "shuffle.client_topic=clients",
        "source.topic=analyzer",
        "source.bootstrap=127.0.0.1:1",
        f"checkpoint.dir={tmp_path / 'state'}",
        "metrics.port=-1",
        *extra,
    ]
    return load_config(None, sets, env={})


@pytest.fixture(scope="module")
def client(keys):
    return ShuffleClient(keys.public_key, GKMPRandomizer(4.0, 1e-6, N, B))


# -- records ---------------------------------------------------------------------------------------
def test_check_record_reasons(client):
    key, value = client.record(3)
    eid, boxes = check_record(key, value)
    assert eid == key.hex() and all(len(b) == SEALED_SIZE for b in boxes)
    cases = [
        (None, value, "no_event_id"),
        (b"short", value, "no_event_id"),
        (key, b"\xc1not msgpack", "undecodable"),
        (key, None, "undecodable"),
        (key, msgpack.packb([1, 2]), "not_a_map"),
        (key, msgpack.packb({"v": 1, "boxes": []}), "not_a_map"),
        (key, client_record([b"x" * 10]), "bad_boxes"),
        (key, client_record([]), "bad_boxes"),
    ]
    for k, v, reason in cases:
        with pytest.raises(ValueError) as exc:
            check_record(k, v)
        assert str(exc.value) == reason, (k, v)


# -- the window ------------------------------------------------------------------------------------
def test_window_dedupes_closes_at_n_and_dead_letters(client):
    recs = client.records(list(range(N + 3)))
    old_key, old_value = client.record(1)
    w = Window(7, N, recent_ids={old_key.hex()}, ends={0: 0, 1: 5})
    assert w.offer(0, 0, *recs[0]) == "event"
    assert w.offer(0, 1, *recs[0]) == "duplicate"  # redelivered in the window
    assert w.offer(1, 5, old_key, old_value) == "duplicate"  # redelivered from a recent window
    assert w.offer(1, 6, b"short", recs[1][1]) == "no_event_id"
    assert w.offer(0, 2, recs[1][0], b"junk") == "undecodable"
    for i, (k, v) in enumerate(recs[1:N]):
        assert w.offer(0, 3 + i, k, v) == "event"
    assert w.full and len(w.events) == N and w.duplicates == 2
    with pytest.raises(RuntimeError):  # never more than n events
        w.offer(0, 99, *recs[N])
    assert w.ends == {0: 3 + N - 1, 1: 7}
    assert [d[0] for d in w.dead] == ["no_event_id", "undecodable"]


def test_window_output_is_the_events_boxes_plus_top_ups(client, keys):
    rz = client.randomizer
    recs = client.records([0, 1, 2, 5])
    w = Window(0, N, set())
    for i, (k, v) in enumerate(recs):
        w.offer(0, i, k, v)
    boxes, missing = w.output(rz, keys.public_key)
    assert missing == N - 4
    mine = [b for _, v in recs for b in check_record(b"k" * 16, v)[1]]
    assert len(boxes) >= len(mine) and set(mine) <= set(boxes) and len(set(boxes)) == len(boxes)
    extra = open_boxes([b for b in boxes if b not in set(mine)], keys)
    # top-ups are noise shares only: no event's own message, so they cancel out on average
    assert extra.shape[1] == 2 and set(np.unique(extra[:, 1])) <= {-1, 1}
    # a full window needs no top-up
    w2 = Window(1, 4, set())
    for i, (k, v) in enumerate(recs):
        w2.offer(0, i, k, v)
    boxes2, missing2 = w2.output(rz, keys.public_key)
    assert missing2 == 0 and sorted(boxes2) == sorted(mine)


def test_top_up_keeps_the_analyzer_noise_law(keys):
    """2 events in a window of n = 6 plus the shuffler's 4 top-ups, decrypted and counted: the
    per-bucket count minus the truth has the DLap(p) mean 0 and variance 2p/(1-p)^2 (the exact
    law is tested on 1e6 draws in tests/test_shuffle.py; this checks the shuffler's part)."""
    n, b = 6, 10
    rz = GKMPRandomizer(3.0, 1e-6, n, b, gamma=0.5)
    c = ShuffleClient(keys.public_key, rz)
    diffs = []
    for _ in range(150):
        w = Window(0, n, set())
        for i, (k, v) in enumerate(c.records([0, 3])):
            w.offer(0, i, k, v)
        boxes, missing = w.output(rz, keys.public_key)
        assert missing == n - 2
        rows = open_boxes(boxes, keys)
        counts = np.bincount(rows[:, 0], weights=rows[:, 1], minlength=b)
        counts[[0, 3]] -= 1
        diffs.append(counts)
    d = np.concatenate(diffs)
    var = 2 * rz.p / (1 - rz.p) ** 2
    assert abs(d.mean()) < 5 * math.sqrt(var / len(d))
    assert 0.75 < d.var() / var < 1.3


# -- the permutation -------------------------------------------------------------------------------
def test_permutation_is_uniform_over_all_orders():
    items = list("abcd")
    perms = list(itertools.permutations(items))
    trials = 48_000
    counts = Counter(tuple(permute(items)) for _ in range(trials))
    assert set(counts) <= set(perms)
    obs = [counts[p] for p in perms]
    assert chisquare(obs).pvalue > 1e-4


def test_permutation_positions_uniform_on_a_large_window():
    m, trials = 200, 2_000
    pos = np.zeros((m, m), dtype=np.int64)  # pos[item, position]
    for _ in range(trials):
        out = permute(list(range(m)))
        assert sorted(out) == list(range(m))
        pos[out, np.arange(m)] += 1
    # every item lands in each tenth of the window about equally often
    tenths = pos.reshape(m, 10, m // 10).sum(axis=2)
    assert chisquare(tenths.ravel(), np.full(m * 10, trials / 10)).pvalue > 1e-4


def test_permutation_redraws_on_a_tie():
    calls = []

    def urandom(k):
        calls.append(k)
        return bytes(k) if len(calls) == 1 else os.urandom(k)  # first draw: all keys equal

    out = permute(list(range(50)), urandom)
    assert len(calls) == 2 and sorted(out) == list(range(50))


# -- restart: the state file against Kafka's committed offsets -------------------------------------
def test_reconcile_promotes_a_committed_pending_window(tmp_path, keys):
    cfg = cfg_for(tmp_path, keys)
    sh = Shuffler(cfg)
    sh.next_window = 3
    sh.recent = [{"window": 2, "ends": {"0": 10}, "ids": ["aa"]}]
    sh.pending = {"window": 3, "ends": {"0": 20}, "ids": ["bb"]}
    sh._save_state()
    again = Shuffler(cfg)  # as after a kill
    start = again._reconcile({0: (20, "window 3"), 1: (None, "")})
    assert again.next_window == 4 and again.pending is None
    assert [w["window"] for w in again.recent] == [2, 3] and again.recent[-1]["ids"] == ["bb"]
    assert start == {0: 20, 1: 0}
    assert Shuffler(cfg).next_window == 4  # saved


def test_reconcile_drops_an_aborted_pending_window(tmp_path, keys):
    cfg = cfg_for(tmp_path, keys)
    sh = Shuffler(cfg)
    sh.next_window = 3
    sh.recent = [{"window": 2, "ends": {"0": 10}, "ids": ["aa"]}]
    sh.pending = {"window": 3, "ends": {"0": 20}, "ids": ["bb"]}
    sh._save_state()
    again = Shuffler(cfg)
    start = again._reconcile({0: (10, "window 2")})
    assert again.next_window == 3 and again.pending is None and start == {0: 10}
    assert [w["window"] for w in again.recent] == [2]


def test_reconcile_state_file_behind_or_offsets_expired(tmp_path, keys):
    cfg = cfg_for(tmp_path, keys)
    sh = Shuffler(cfg)  # no state file at all
    assert sh._reconcile({0: (40, "window 5")}) == {0: 40} and sh.next_window == 6
    sh.recent = [{"window": 5, "ends": {"0": 40, "1": 7}, "ids": []}]
    # offsets expired while stopped: resume where the state file says window 5 ended
    assert sh._reconcile({0: (None, ""), 1: (None, "")}) == {0: 40, 1: 7}


def test_recent_ids_are_bounded(tmp_path, keys):
    sh = Shuffler(cfg_for(tmp_path, keys))
    sh.recent = [{"window": i, "ends": {}, "ids": [str(i)]} for i in range(10)]
    sh._save_state()
    assert len(Shuffler(cfg_for(tmp_path, keys)).recent) == RECENT_WINDOWS


# -- configuration errors: one line each -----------------------------------------------------------
@pytest.mark.parametrize(
    "extra, words",
    [
        (["shuffle.client_topic="], "shuffle.client_topic"),
        (["shuffle.public_key="], "shuffle.public_key"),
        (["shuffle.public_key=zz"], "shuffle.public_key"),
        (["shuffle.analyzer_topic=clients"], "must differ"),
    ],
)
def test_config_errors_are_one_line(tmp_path, keys, extra, words):
    with pytest.raises(ShufflerError) as exc:
        Shuffler(cfg_for(tmp_path, keys, *extra))
    assert words in str(exc.value) and "\n" not in str(exc.value)


# -- clients: the service's item -> bucket maps ----------------------------------------------------
def test_client_maps_items_like_the_service(tmp_path, keys):
    cfg = cfg_for(tmp_path, keys)
    c = ShuffleClient.from_config(cfg)
    assert c.bucket(7) == 7
    with pytest.raises(ValueError):
        c.bucket(B)
    with pytest.raises(ValueError):
        bucket_map(cfg)(["text"])
    hk = "00112233445566778899aabbccddeeff"
    hcfg = cfg_for(
        tmp_path,
        keys,
        "state.mode=hashed",
        "state.buckets=64",
        f"shuffle.hash_key={hk}",
        "item.casefold=true",
    )
    hc = ShuffleClient.from_config(hcfg)
    items = ["Alice", "bob", "ALICE", 17, b"raw"]
    want = bucket_of(["alice", "bob", "alice", 17, b"raw"], bytes.fromhex(hk), 64)
    assert hc.to_bucket(items).tolist() == want.tolist()
    rows = open_boxes(hc.messages("Alice"), keys)
    assert ((rows[:, 0] == want[0]) & (rows[:, 1] == 1)).any()
    assert len(hc.records(items)) == len(items)
    with pytest.raises(ShufflerError, match="shuffle.hash_key"):
        ShuffleClient.from_config(cfg_for(tmp_path, keys, "state.mode=hashed", "state.buckets=64"))


def test_randomizer_shared_by_clients_and_shuffler(tmp_path, keys):
    cfg = cfg_for(tmp_path, keys)
    a, b = make_randomizer(cfg), Shuffler(cfg).randomizer
    assert (a.n, a.buckets, a.p) == (b.n, b.buckets, b.p) == (N, B, a.p)


# -- issue 31: the fingerprint and the message rate ------------------------------------------------
def test_param_tag_is_rebuilt_from_parts_and_checked():
    from aggregator.service.shuffle_wire import DESC_PARTS, ParamTag, open_messages, seal_rows

    keys = new_keypair()
    rz = GKMPRandomizer(2.0, 1e-5, 500, 12, gamma=0.2)
    tag = ParamTag.of(rz)
    opened = open_messages(
        seal_rows(rz.encode_many(np.arange(40) % 12)[0], keys.public_key, tag), keys
    )
    assert (opened.fingerprints == tag.fingerprint_u64).all()
    parts = {int(i): int(c).to_bytes(8, "little") for i, c in zip(opened.part, opened.chunk)}
    assert sorted(parts) == list(range(DESC_PARTS))
    back = ParamTag.from_parts(tag.fingerprint_u64, parts)
    assert back == tag and back.params == rz.params
    assert ParamTag.from_parts(tag.fingerprint_u64 ^ 1, parts) is None  # hash checked
    assert ParamTag.from_parts(tag.fingerprint_u64, {0: parts[0]}) is None  # parts missing
    other = ParamTag(dict(rz.params, epsilon=1.0))
    assert other.fingerprint != tag.fingerprint
    assert other.differences(tag) == [("epsilon", "1", "2")]
    # the part a message carries is independent of its row: the event's own (x, +1) row is the
    # first one, and its part is spread like any other's
    firsts = [
        open_messages(seal_rows(rz.encode(3)[:1], keys.public_key, tag), keys).part[0]
        for _ in range(300)
    ]
    assert set(firsts) == set(range(DESC_PARTS))


def test_message_rate_far_from_expected_is_flagged():
    """The issue's case at a smaller scale: clients at eps 2 against a shuffler at eps 1 send
    about half the messages; the same clients at eps 1 pass."""
    from aggregator.service.shuffler import rate_problem

    mine = GKMPRandomizer(1.0, 1e-6, 2000, 200)
    for other, flagged in (
        (GKMPRandomizer(2.0, 1e-6, 2000, 200), True),
        (GKMPRandomizer(1.0, 1e-6, 2000, 100), True),
        (GKMPRandomizer(1.0, 1e-6, 2000, 200), False),
    ):
        rows, _ = other.encode_many(np.arange(2000) % other.buckets)
        problem = rate_problem(mine, 2000, len(rows))
        assert (problem is not None) == flagged, (other, len(rows) / 2000, problem)
        if flagged:
            assert "messages per event where" in problem
    assert rate_problem(mine, 10, 1) is None  # too few events to tell


def test_box_opener_helpers_give_the_same_messages():
    """Decryption split with a helper process (the analyzer's default on 2+ CPUs): the same
    rows, fingerprints and parts as in-process, in order; a box of another key fails the chunk."""
    from aggregator.service.shuffle_wire import (
        POOL_MIN_BOXES,
        BoxOpener,
        ParamTag,
        WireError,
        open_messages,
        seal_rows,
    )

    keys = new_keypair()
    tag = ParamTag(
        {"protocol": "gkmp", "epsilon": 1.0, "delta": 1e-6, "n": 100, "buckets": 50, "gamma": 0.1}
    )
    m = POOL_MIN_BOXES + 11
    rows = np.column_stack([np.arange(m) % 50, np.where(np.arange(m) % 3, 1, -1)])
    boxes = seal_rows(rows, keys.public_key, tag)
    want = open_messages(boxes, keys)
    opener = BoxOpener(keys, workers=2)
    try:
        got = opener.open(boxes)
        assert len(opener._procs) == 2
        for a, b in (
            (got.rows, want.rows),
            (got.fingerprints, want.fingerprints),
            (got.part, want.part),
            (got.chunk, want.chunk),
        ):
            assert np.array_equal(a, b)
        stranger = seal_rows(rows[:1], new_keypair().public_key, tag)
        with pytest.raises(WireError):
            opener.open(boxes[:-1] + stranger)  # the last slice: this process's own
        with pytest.raises(WireError):
            opener.open(stranger + boxes[1:])  # the first: a helper's
        assert np.array_equal(opener.open(boxes).rows, want.rows)  # helpers still serve
    finally:
        opener.close()
    assert opener._procs == []


def test_a_refused_shuffler_start_writes_nothing(tmp_path, keys):
    # Kafka unreachable: waited for up to source.connect_timeout_s as `panagg run` does (before,
    # it exited at once: a shuffler restarted during a broker restart crash-looped; found by the
    # fault harness, docs/chaos.md), then one line naming the fix, and no shuffler directory left
    # behind (it is made at the first save of the shuffler's state, not when it is built)
    import subprocess
    import sys

    sets = [
        "state.model=shuffle",
        "state.epsilon=4",
        f"state.domain_size={B}",
        f"window.size={N}",
        f"shuffle.public_key={public_key_hex(keys)}",
        "shuffle.client_topic=clients",
        "source.topic=analyzer",
        "source.bootstrap=127.0.0.1:1",
        "source.connect_timeout_s=2",
        f"checkpoint.dir={tmp_path / 'state'}",
        "metrics.port=-1",
    ]
    toml = tmp_path / "shuffler.toml"
    toml.write_text('[state]\nmodel = "shuffle"\n')
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "shuffle",
            "--config",
            str(toml),
            *[a for kv in sets for a in ("--set", kv)],
            "--exit-when-idle",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    cfg = cfg_for(tmp_path, keys)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "panagg: error: cannot reach Kafka: connection refused at 127.0.0.1:1 (nothing listens "
        "on that port) for 2 s (source.connect_timeout_s). Check source.bootstrap and that the "
        "broker is running (deploy/kafka/kafka.sh start)"
    )
    assert "waiting up to 2 s for it (source.connect_timeout_s)" in res.stderr
    assert "kafka.net" not in res.stderr  # no burst of client retries
    assert not (tmp_path / "state").exists()
    sh = Shuffler(cfg)
    assert not (tmp_path / "state").exists()  # building it writes nothing
    sh._save_state()
    assert (tmp_path / "state" / "shuffler").is_dir()
