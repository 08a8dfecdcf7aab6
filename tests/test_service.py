"""The service without Kafka: file replay through decode -> count -> checkpoint -> release.

Exactly-once and crash behaviour are checked with the test-only deterministic noise source
(testing.noise_seed, honoured only under PANAGG_TESTING=1): the final counters must equal that
noise plus the true counts.
"""

import json
import os
import signal
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.service.config import ConfigError, load_config
from aggregator.service import Aggregator
from aggregator.state import PanPrivateHistogram
from consumers.decode import REASONS, Decoder
from consumers.file_source import FileSource
from state_store.audit import ExportError, read_export
from tests.helpers.service import (
    D,
    KEY_HEX,
    cfg_for,
    cli_sets,
    durable,
    expected_noise,
    expected_release,
    expected_state,
    generator_service,
    ledger_entries,
    live_counts_via_export,
    pause_line_said_once,
    run_cli,
    write_events,
)


BAD_LINES = [
    (3, "not json at all"),  # undecodable
    (10, json.dumps([1, 2, 3])),  # not_a_map
    (20, json.dumps({"user": 5})),  # missing_item
    (30, json.dumps({"item": 1.5})),  # wrong_type
    (40, json.dumps({"item": "alice"})),  # wrong_type (direct mode)
    (50, json.dumps({"item": 10**6})),  # out_of_range
    (60, json.dumps({"item": 1, "pad": "x" * 70000})),  # oversized
]


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def good_items(path):
    """The items a file's good lines carry, in order (the bad lines of BAD_LINES dropped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        item = doc.get("item") if isinstance(doc, dict) else None
        if (
            isinstance(item, int)
            and not isinstance(item, bool)
            and 0 <= item < D
            and len(line) < 65536
        ):
            out.append(item)
    return out


def test_file_replay_counts_exactly_and_sorts_bad_input(tmp_path):
    items = np.random.default_rng(1).integers(0, D, 9000)
    path = tmp_path / "events.jsonl"
    write_events(path, items, BAD_LINES)
    cfg = cfg_for(tmp_path, path, **{"release.on_exhausted": "false"})
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=1000, progress=False))
    agg.run()
    task = agg.task
    assert task.state.n == 9000 and task.window["events"] == 9000
    assert np.array_equal(task.state.counts, expected_noise() + np.bincount(items, minlength=D))
    assert task.offsets == {"file:events.jsonl": 9000 + len(BAD_LINES)}
    errors = {r: agg.metrics.decode_errors.labels(reason=r)._value.get() for r in REASONS}
    assert errors == {
        "undecodable": 1,
        "not_a_map": 1,
        "missing_item": 1,
        "wrong_type": 2,
        "out_of_range": 1,
        "oversized": 1,
    }
    assert task.totals["rejects"] == {r: c for r, c in errors.items() if c}
    assert agg.metrics.events._value.get() == 9000 == task.totals["events"]
    # the open window's counters were never written: the only checkpoint is the window start
    ckpt = durable(tmp_path)
    assert ckpt.state is None and ckpt.offsets == {} and ckpt.window["events"] == 0


def test_count_windows_split_batches_exactly(tmp_path):
    items = np.random.default_rng(2).integers(0, D, 2500)
    path = tmp_path / "events.jsonl"
    write_events(path, items, BAD_LINES)
    cfg = cfg_for(tmp_path, path, **{"window.size": 1000, "state.model": "state-only"})
    Aggregator(cfg, FileSource(str(path), "json", batch=700, progress=False)).run()
    rel = sorted((tmp_path / "releases").glob("release-*.json"))
    assert [p.name for p in rel] == ["release-0.json", "release-1.json", "release-2.json"]
    docs = [json.loads(p.read_text()) for p in rel]
    assert [d["n"] for d in docs] == [1000, 1000, 500]
    assert all(d["window_info"]["events"] == d["n"] for d in docs)
    for w, d in enumerate(docs):  # each window holds exactly its events
        want = expected_release(items[w * 1000 : (w + 1) * 1000], w, model="state-only")
        assert d["histogram"] == want["histogram"]
    ledger = ledger_entries(tmp_path)
    assert [e["kind"] for e in ledger] == ["identity", "release", "release", "release"]
    assert [e["window"] for e in ledger[1:]] == [0, 1, 2]
    assert len({e["window_uid"] for e in ledger[1:]}) == 3
    assert all(
        e["epsilon_spent"] == 1.0 and json.loads(e["document"])["window"] == e["window"]
        for e in ledger[1:]
    )
    ckpt = durable(tmp_path)
    assert ckpt.window["id"] == 3 and ckpt.window["events"] == 0 and ckpt.state is None


@pytest.mark.parametrize(
    "fault",
    [
        "checkpoint-mid-write:2",
        "checkpoint-before-rename:3",
        "checkpoint-after-rename:4",
        "checkpoint-mid-write:6",
    ],
)
def test_kill_inside_checkpoint_write_loses_and_repeats_nothing(tmp_path, fault):
    items = np.random.default_rng(3).integers(0, D, 12000)
    path = tmp_path / "events.jsonl"
    write_events(path, items, BAD_LINES)
    args = cli_sets(tmp_path, path, **{"window.size": 3000, "release.on_exhausted": "false"})
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault})
    assert first.returncode == -9, first.stderr  # SIGKILLed at the fault point
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    for w in range(4):  # every window released once, from exactly its events
        doc = json.loads((tmp_path / "releases" / f"release-{w}.json").read_text())
        want = expected_release(items[w * 3000 : (w + 1) * 3000], w)
        assert doc["n"] == 3000 and doc["histogram"] == want["histogram"], w
    releases = [e for e in ledger_entries(tmp_path) if e["kind"] == "release"]
    assert [e["window"] for e in releases] == [0, 1, 2, 3]
    ckpt = durable(tmp_path)
    assert ckpt.window["id"] == 4 and ckpt.pending == [] and ckpt.state is None
    assert ckpt.totals["events"] == 12000 and sum(ckpt.totals["rejects"].values()) == 7
    assert not list((tmp_path / "state" / "checkpoints").glob(".*tmp*"))


def test_crash_between_window_close_and_publish_republishes_once(tmp_path):
    items = np.random.default_rng(4).integers(0, D, 3000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(tmp_path, path, **{"window.size": 2000, "release.on_exhausted": "false"})
    # checkpoint 1 starts window 0; checkpoint 2 closes it with the pending release
    first = run_cli(args, {"PANAGG_TEST_FAULT": "checkpoint-after-rename:2"})
    assert first.returncode == -9
    assert not (tmp_path / "releases" / "release-0.json").exists()
    ckpt = durable(tmp_path)
    assert len(ckpt.pending) == 1 and ckpt.window["id"] == 1
    pending = json.loads(ckpt.pending[0])
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    published = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert published["histogram"] == pending["histogram"]  # the same document, not a new draw
    assert [e["kind"] for e in ledger_entries(tmp_path) if e["kind"] != "restart"] == [
        "identity",
        "release",
    ]
    counts, _, _ = live_counts_via_export(tmp_path)
    assert np.array_equal(counts, expected_state(items[2000:], 1).counts)
    assert durable(tmp_path).pending == []


def test_crash_after_the_ledger_entry_republishes_the_ledgered_release(tmp_path):
    items = np.random.default_rng(41).integers(0, D, 3000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(tmp_path, path, **{"window.size": 2000, "release.on_exhausted": "false"})
    # killed inside the close's checkpoint: the release is ledgered, the checkpoint is not
    first = run_cli(args, {"PANAGG_TEST_FAULT": "checkpoint-mid-write:2"})
    assert first.returncode == -9
    (entry,) = [e for e in ledger_entries(tmp_path) if e["kind"] == "release"]
    assert durable(tmp_path).window["id"] == 0
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    published = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert published == json.loads(entry["document"])  # re-published, never recomputed
    assert [e["kind"] for e in ledger_entries(tmp_path) if e["kind"] != "restart"] == [
        "identity",
        "release",
    ]
    counts, _, _ = live_counts_via_export(tmp_path)  # window 1 starts where window 0 ended
    assert np.array_equal(counts, expected_state(items[2000:], 1).counts)


def test_ledger_refuses_over_budget_release(tmp_path):
    items = np.random.default_rng(5).integers(0, D, 3000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    cfg = cfg_for(tmp_path, path, **{"window.size": 1000, "ledger.budget_total": 2.0})
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=1000, progress=False))
    agg.run()  # a finite run goes to its end: each window the budget cannot pay is refused
    assert sorted(p.name for p in (tmp_path / "releases").glob("*.json")) == [
        "release-0.json",
        "release-1.json",
    ]
    assert agg.metrics.releases_refused._value.get() == 1
    assert agg.ledger.spent() == 2.0
    assert agg.metrics.budget_remaining._value.get() == 0.0
    refused = [e for e in ledger_entries(tmp_path) if e["kind"] == "refused"]
    assert [e["window"] for e in refused] == [2] and refused[0]["epsilon_spent"] == 0


def test_spent_budget_pauses_an_endless_stream(tmp_path, caplog):
    """Kafka runs do not end: the loop stops consuming, says so once, and reports not ready."""
    items = np.random.default_rng(5).integers(0, D, 1000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    cfg = cfg_for(tmp_path, path, **{"window.size": 1000, "ledger.budget_total": 1.0})
    Aggregator(cfg, FileSource(str(path), "json", batch=1000, progress=False)).run()
    agg, line = pause_line_said_once(cfg, path, caplog)
    assert line.startswith(
        "privacy budget spent: 1 of ledger.budget_total=1 leaves 0 < 1 for a window, so intake "
        "is paused"
    )
    assert "Fix: raise ledger.budget_total" in line
    assert agg.metrics.readiness()[0] == 503
    assert agg.metrics.intake_paused._value.get() == 1
    agg.close()


def test_audit_export_adds_layers_is_signed_and_ledgered(tmp_path, monkeypatch):
    items = np.random.default_rng(6).integers(0, D, 2000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(tmp_path, path, **{"release.on_exhausted": "false"})
    assert run_cli(args).returncode == 0
    no_key = run_cli(["audit", "export", "--state-dir", str(tmp_path / "state")])
    assert no_key.returncode == 2 and "PANAGG_AUDIT_KEY" in no_key.stderr
    counts, exported, doc = live_counts_via_export(tmp_path)
    # the export is the replayed window plus one fresh layer: exact counts under it
    assert np.array_equal(counts, expected_state(items, 0).counts)
    assert exported.layers == 2 and exported.n == 2000
    # the checkpoint now holds that snapshot, so a restart resumes from it under one more layer
    ckpt = durable(tmp_path)
    assert PanPrivateHistogram.deserialize(ckpt.state).layers == 2
    assert ckpt.state == doc["state"]
    ledger = ledger_entries(tmp_path)
    assert ledger[-1]["kind"] == "export" and ledger[-1]["epsilon_spent"] == 0.0
    export_path = next((tmp_path / "state" / "exports").glob("export-*.panagg"))
    ok = run_cli(["audit", "verify", str(export_path)], {"PANAGG_AUDIT_KEY": KEY_HEX})
    assert ok.returncode == 0 and ok.stdout.startswith("OK")
    bad = run_cli(["audit", "verify", str(export_path)], {"PANAGG_AUDIT_KEY": "ab" * 32})
    assert bad.returncode == 2 and "does not verify" in bad.stderr
    shown = run_cli(["audit", "show", str(export_path)])
    assert json.loads(shown.stdout)["layers"] == exported.layers
    tampered = bytearray(export_path.read_bytes())
    tampered[len(tampered) // 2] ^= 1
    export_path.write_bytes(bytes(tampered))
    with pytest.raises(ExportError):
        read_export(export_path, bytes.fromhex(KEY_HEX))
    # releasing the window now: the snapshot (2 layers) + restore layer + release layer
    rel = run_cli(["release", "--state-dir", str(tmp_path / "state")])
    assert rel.returncode == 0, rel.stderr
    assert json.loads((tmp_path / "releases" / "release-0.json").read_text())["layers"] == 4


def test_no_payload_in_logs_metrics_or_errors(tmp_path):
    secret = "SECRET-PAYLOAD-7f3a"
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"item": i % D}) for i in range(3000)]
    lines += [
        json.dumps({"item": secret}),
        secret,
        json.dumps({"item": 10**9, "x": secret}),
        json.dumps({"user": secret}),
    ]
    path.write_text("\n".join(lines) + "\n")
    args = cli_sets(tmp_path, path, **{"metrics.port": 0}) + ["--verbose"]
    res = run_cli(args)
    assert res.returncode == 0, res.stderr
    assert secret not in res.stdout and secret not in res.stderr
    # rejects are logged by position and reason (the file source's positions are line numbers)
    rejected = [
        ln.split(": ", 1)[1] for ln in res.stderr.splitlines() if "rejected record at " in ln
    ]
    assert len(rejected) == 4 and all(ln.startswith("rejected record at file:") for ln in rejected)
    for f in (tmp_path / "state").rglob("*"):
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
    for f in (tmp_path / "releases").rglob("*"):
        assert secret.encode() not in f.read_bytes()


def test_reject_log_is_rate_limited(caplog):
    from aggregator.service.rejects import RejectLog

    rl = RejectLog(burst=3, period_s=3600)
    with caplog.at_level("WARNING", logger="panagg.service"):
        for off in range(50):
            rl.record("t:0", 100 + off, "undecodable" if off % 2 else "missing_item")
        rl.flush(force=True)
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[:3] == [
        "rejected record at t:0 offset 100: missing_item",
        "rejected record at t:0 offset 101: undecodable",
        "rejected record at t:0 offset 102: missing_item",
    ]
    assert len(msgs) == 4 and msgs[3].startswith("47 more rejected records in the last ")
    assert msgs[3].endswith(
        "(missing_item: 23, undecodable: 24); counts by reason in panagg_decode_errors_total"
    )


@pytest.mark.parametrize(
    "sets, fragment",
    [
        (["window.size=0"], "window.size must be positive"),
        (["state.model=central"], "state.model must be one of"),
        (["state.epsilon=abc"], "state.epsilon must be a number"),
        (["nosuch.key=1"], "expected section.key=value"),
        (["testing.noise_seed=1"], "refused outside tests"),
    ],
)
def test_bad_config_is_one_line(sets, fragment, monkeypatch):
    monkeypatch.delenv("PANAGG_TESTING")
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, sets, env={})
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            *sum([["--set", s] for s in sets], []),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PANAGG_TESTING"},
    )
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1 and fragment in res.stderr


def test_config_file_env_and_flags_layer(tmp_path):
    toml = tmp_path / "panagg.toml"
    toml.write_text(
        '[state]\nepsilon = 2.0\ndomain_size = 77\n[window]\nkind = "time"\nsize = 60\n'
    )
    cfg = load_config(str(toml), ["state.domain_size=88"], env={"PANAGG_STATE_EPSILON": "0.5"})
    assert cfg.state.epsilon == 0.5 and cfg.state.domain_size == 88
    # (time windows of the default Kafka source: by the records' timestamps, window.clock)
    assert (cfg.window.kind, cfg.window.size) == ("event_time", 60)
    toml.write_text("[state]\nepsilon = [1]\n")
    with pytest.raises(ConfigError, match="state.epsilon must be a number"):
        load_config(str(toml), env={})
    toml.write_text("[stat]\n")
    with pytest.raises(ConfigError, match="unknown config section"):
        load_config(str(toml), env={})


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.builds(
            lambda d: msgpack.packb(d),
            st.recursive(
                st.none()
                | st.booleans()
                | st.integers(-(2**63), 2**64 - 1)
                | st.floats(allow_nan=True)
                | st.text()
                | st.binary(),
                lambda kids: (
                    st.lists(kids, max_size=3)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                ),
                max_leaves=6,
            ),
        ),
        st.builds(
            lambda v: msgpack.packb({"item": v}),
            st.integers(-(2**63), 2**64 - 1) | st.text() | st.binary(),
        ),
        st.builds(
            lambda v: json.dumps({"item": v}).encode(), st.integers() | st.text() | st.floats()
        ),
    )
)
def test_decoder_never_raises_and_always_classifies(raw):
    for decoder in (Decoder("msgpack", domain_size=100), Decoder("msgpack"), Decoder("json")):
        item, reason = decoder.decode_one(raw)
        assert (reason is None) != (item is None)
        if reason is None:
            assert isinstance(item, (int, str, bytes)) and not isinstance(item, bool)
            if decoder.domain_size:
                assert 0 <= item < 100
        else:
            assert reason in REASONS


def test_time_windows_release_each_window_with_fresh_noise(tmp_path):
    from consumers.generator import GeneratorSource, ZipfLogins

    cfg = load_config(
        None,
        [
            f"state.domain_size={D}",
            "window.kind=time",
            "window.size=1",
            "window.clock=process",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "state.model=state-only",
            # 1 s windows: keep each release short on a loaded machine
            "release.error_bar_reps=0",
        ],
        env={},
    )
    # ~4 s of events: at least two 1 s windows even when each release takes a second (the
    # rate-limited generator catches up after a release, so a slow release merges windows)
    gen = ZipfLogins(events=8000, accounts=D, batch=500, seed=3)
    agg = Aggregator(cfg, GeneratorSource(gen, rate=2000.0))
    agg.run()
    docs = [json.loads(p.read_text()) for p in sorted((tmp_path / "releases").glob("*.json"))]
    assert len(docs) >= 2
    assert sum(d["n"] for d in docs) == 8000
    assert all(d["window_info"]["kind"] == "time" for d in docs)
    for d in docs[:-1]:  # closed by the clock, not before one second (later on a loaded machine)
        span = d["window_info"]["ended_unix"] - d["window_info"]["started_unix"]
        assert span >= 0.9
    assert [d["window"] for d in docs] == list(range(len(docs)))


def test_batch_fast_path_agrees_with_per_message_decoding():
    rng = np.random.default_rng(9)
    good = [msgpack.packb({"item": int(i)}) for i in rng.integers(0, 100, 500)]
    cases = {
        "all good": good,
        "out of range": good[:100] + [msgpack.packb({"item": 10**4})] + good[100:],
        "two objects + empty": good[:50] + [good[0] + good[1], b""] + good[50:],
        "two objects + short": good[:50] + [good[0] + good[1][:3], good[1][3:]] + good[50:],
        "wrong type": good + [msgpack.packb({"item": "x"})],
        "garbage": good + [b"\xc1\xc1"],
    }
    for name, values in cases.items():
        for decoder in (Decoder(domain_size=100), Decoder()):
            fast = decoder.decode(values)
            slow_items, slow_rej = [], []
            for i, v in enumerate(values):
                item, reason = decoder.decode_one(v)
                if reason is None:
                    slow_items.append(item)
                else:
                    slow_rej.append((i, reason))
            assert list(fast.items) == slow_items, name
            assert fast.rejected == slow_rej, name


def test_release_and_export_requests_reach_a_running_service(tmp_path):
    state_dir = tmp_path / "state"
    env = dict(os.environ, PANAGG_TESTING="1", PANAGG_AUDIT_KEY=KEY_HEX)
    # 25 s of events: the two requests must reach the service before its finite source ends (at
    # 5 s a loaded machine let it end first; the CLI now says so at once instead of waiting)
    with generator_service(tmp_path, env, events=40000, rate=1600) as proc:
        rel = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "release",
                "--state-dir",
                str(state_dir),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert rel.returncode == 0, rel.stderr
        assert rel.stdout.strip() == "released window 0 (by the running service)"
        exp = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "audit",
                "export",
                "--state-dir",
                str(state_dir),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert exp.returncode == 0, exp.stderr
        doc = read_export(exp.stdout.strip(), bytes.fromhex(KEY_HEX))
        assert doc["window"]["id"] == 1 and doc["verified"]
    assert proc.returncode == 0, proc.stderr
    released = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert 0 < released["n"] < 40000 and released["layers"] == 2
    ckpt = durable(tmp_path)  # the export's snapshot, from which window 1 resumes
    assert ckpt.window["id"] == 1 and PanPrivateHistogram.deserialize(ckpt.state).layers == 2
    rest = run_cli(["release", "--state-dir", str(state_dir)], {"PANAGG_AUDIT_KEY": KEY_HEX})
    assert rest.returncode == 0, rest.stderr
    second = json.loads((tmp_path / "releases" / "release-1.json").read_text())
    # the window's events after the export were replayed (the generator continues at the
    # checkpoint's offset); the export's layers and a restore layer live on in the window
    assert released["n"] + second["n"] == 40000 and second["layers"] == 4


def test_export_key_error_points_at_the_running_service(tmp_path):
    """The service signs with its own key: a key in the asking shell does not help, and the
    error says where the key must be."""
    state_dir = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k != "PANAGG_AUDIT_KEY"}
    env["PANAGG_TESTING"] = "1"
    # a source that outlasts the request however slow the machine, then a stop (a clean exit)
    with generator_service(tmp_path, env, events=10**6, rate=6000, settle=1.0) as proc:
        exp = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "audit",
                "export",
                "--state-dir",
                str(state_dir),
            ],
            env=dict(env, PANAGG_AUDIT_KEY=KEY_HEX),
            capture_output=True,
            text=True,
            timeout=120,
        )
        proc.send_signal(signal.SIGTERM)
    assert exp.returncode == 2
    lines = exp.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "panagg: error: the running service cannot sign the export: no audit signing key"
    )
    assert lines[0].endswith(
        "The key is read by the service from its own environment or its "
        "audit.key_file, not from this shell: set it there and restart the "
        "service"
    )
    assert proc.returncode == 0, proc.stderr


def test_status_and_history_of_a_state_dir(tmp_path):
    items = np.random.default_rng(8).integers(0, D, 2500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    state = str(tmp_path / "state")
    missing = run_cli(["status", "--state-dir", str(tmp_path / "typo")])
    assert missing.returncode == 2 and missing.stderr.strip() == (
        f"panagg: error: {tmp_path / 'typo'} holds no panagg state (no ledger.jsonl); pass the "
        "--state-dir (checkpoint.dir) the service runs with"
    )
    assert not (tmp_path / "typo").exists()  # read-only: nothing created
    assert (
        run_cli(
            cli_sets(tmp_path, path, **{"window.size": 1000, "release.on_exhausted": "false"})
        ).returncode
        == 0
    )
    res = run_cli(["status", "--state-dir", state])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[1] == "service: not running"
    assert lines[2].startswith(
        "counts: file:events.jsonl (group -), direct mode over 500 "
        "counters, eps 1 per window, count:1000 windows"
    )
    assert lines[3] == (
        "privacy unit: the event (a source that contributes g events is "
        "protected at g x eps; docs/privacy_unit.md)"
    )
    assert lines[4].startswith("window: 2 open since ") and "none on disk by design" in lines[4]
    assert "budget: eps 2 spent (no total cap)" in lines
    last = [ln for ln in lines if ln.startswith("last release: window 1 at ")]
    assert len(last) == 1 and "n=1,000, distinct " in last[0]
    doc = json.loads(run_cli(["status", "--state-dir", state, "--json"]).stdout)
    assert doc["window"]["id"] == 2 and doc["releases"] == 2 and doc["budget"]["spent"] == 2.0
    assert doc["privacy_unit"]["unit"] == "event"
    hist = run_cli(["history", "--state-dir", state, "--plot", str(tmp_path / "h.png")])
    assert hist.returncode == 0, hist.stderr
    rows = hist.stdout.splitlines()
    assert [r.split(" at ")[0] for r in rows] == ["window 0", "window 1"]
    assert "; vs window 0 at level 0.9: distinct" in rows[1]
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = run_cli(["history", "--state-dir", state, "--plot", str(tmp_path / "h.png")])
    assert again.returncode == 2 and "exists; give a new file name" in again.stderr
    rows = json.loads(run_cli(["history", "--state-dir", state, "--json"]).stdout)
    assert [r["n"] for r in rows] == [1000, 1000]
    # (500 counters, 1,000 events: whether an interval reaches 2x off varies with the draw)
    assert all(
        r["distinct_items_interval"]
        and r["signal_below_noise"] in (False, True)
        and r["expected_relative_error"]["distinct_items"] > 0
        for r in rows
    )


def test_status_asks_the_running_service(tmp_path):
    """Progress, health and readiness come from the running service's own endpoints."""
    state_dir = tmp_path / "state"
    env = dict(os.environ, PANAGG_TESTING="1")
    # a source that outlasts the request however slow the machine, then a stop (a clean exit)
    with generator_service(
        tmp_path, env, events=10**6, rate=8000, metrics_port="0", ready="metrics.url"
    ) as proc:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "aggregator.service.cli",
                "status",
                "--state-dir",
                str(state_dir),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        proc.send_signal(signal.SIGTERM)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[1] == "service: running"
    win = [ln for ln in lines if ln.startswith("window: 0 open since ")]
    assert len(win) == 1 and " events so far (" in win[0]
    assert "health: ok; ready" in lines
    assert proc.returncode == 0, proc.stderr


def test_file_modes_do_not_follow_the_umask(tmp_path, monkeypatch):
    """Releases are public (0644) and views of the state private (0600), whatever the umask."""
    items = np.random.default_rng(9).integers(0, D, 1500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    for umask in (0o022, 0o077):
        old = os.umask(umask)
        try:
            out = tmp_path / f"u{umask:o}"
            # the same file twice on purpose: outside the budget registry (test_budget_lineage)
            cfg = cfg_for(
                out,
                path,
                **{"window.size": 1000, "ledger.file_registry": "", "release.plots": "true"},
            )
            Aggregator(cfg, FileSource(str(path), "json", batch=500, progress=False)).run()
        finally:
            os.umask(old)
        modes = {
            p.relative_to(out).as_posix(): p.stat().st_mode & 0o777
            for p in out.rglob("*")
            if p.is_file()
        }
        releases = {k: m for k, m in modes.items() if k.startswith("releases/")}
        assert {k.split("/")[-1] for k in releases} >= {"release-0.json", "release-0.png"}
        assert set(releases.values()) == {0o644}, releases
        checkpoints = {k: m for k, m in modes.items() if k.startswith("state/checkpoints/")}
        assert checkpoints and set(checkpoints.values()) == {0o600}, checkpoints


def test_progress_and_stop_lines(tmp_path, caplog):
    items = np.random.default_rng(10).integers(0, D, 1500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    cfg = cfg_for(tmp_path, path, **{"window.size": 1000, "release.on_exhausted": "false"})
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=300, progress=False))
    agg.health.progress_every_s = 0.0  # every turn (a minute in production)
    with caplog.at_level("INFO", logger="panagg.service"):
        agg.run()
    lines = [r.getMessage() for r in caplog.records]
    progress = [ln for ln in lines if ln.startswith("progress: ")]
    assert progress and progress[-1].startswith("progress: 1,500 events counted (")
    assert progress[-1].endswith("window 1 at 500 events, lag 0 records")
    assert lines[-1] == (
        "stopped (input ended or idle): window 1 open with 500 events; the last "
        "checkpoint holds its start (checkpoint 3, at offsets "
        "file:events.jsonl: 1000), so the next start replays it from the source"
    )


def test_exit_when_idle_waits_for_an_assignment(tmp_path):
    """--exit-when-idle once ended a Kafka run before the group had assigned any partition."""
    import threading

    from consumers.base import Source

    class Unassigned(Source):
        def __init__(self):
            self.assigned: set[str] = set()
            self.polls = 0

        def poll(self, timeout_s=1.0):
            self.polls += 1
            time.sleep(0.01)
            return []

        def caught_up(self, keys):
            return True

    src = Unassigned()
    cfg = cfg_for(tmp_path, tmp_path / "unused.jsonl")
    agg = Aggregator(cfg, src)
    done = threading.Event()
    t = threading.Thread(
        target=lambda: (agg.run(idle_exit_s=0.05, poll_timeout_s=0.01), done.set())
    )
    t.start()
    assert not done.wait(1.0)  # no partitions yet: not idle, however long it takes
    assert src.polls > 10
    src.assigned.add("topic:0")  # assigned and read to the end: now idle counts
    assert done.wait(10.0)
    t.join(10)


def test_offline_release_of_a_stopped_service(tmp_path):
    items = np.random.default_rng(7).integers(0, D, 1500)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    assert run_cli(cli_sets(tmp_path, path, **{"release.on_exhausted": "false"})).returncode == 0
    res = run_cli(["release", "--state-dir", str(tmp_path / "state")])
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "releases" / "release-0.json").read_text())["n"] == 1500
    again = run_cli(["release", "--state-dir", str(tmp_path / "state")])  # window 1 is empty
    assert again.returncode == 0


def test_hashed_mode_counts_strings_and_releases(tmp_path):
    rng = np.random.default_rng(12)
    users = [f"user-{i}@example.org" for i in range(3000)]
    weights = 1 / np.arange(1, len(users) + 1) ** 1.1
    picks = rng.choice(len(users), size=20000, p=weights / weights.sum())
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps({"item": users[i]}) for i in picks) + "\n")
    cfg = cfg_for(
        tmp_path, path, **{"state.mode": "hashed", "state.expected_n": 20000, "window.size": 20000}
    )
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=4000, progress=False))
    agg.run()
    assert agg.size >= 20000  # B chosen from expected_n before any data
    rel = json.loads((tmp_path / "releases" / "release-0.json").read_text())
    assert rel["n"] == 20000 and rel["domain"]["mode"] == "hashed"
    released = np.repeat(
        [r for r, _ in rel["histogram"]["pairs"]], [c for _, c in rel["histogram"]["pairs"]]
    )
    truth = np.bincount(picks)
    truth = truth[truth > 0]
    from aggregator.estimate import l1_distance

    err = l1_distance(released, truth)
    assert err < 0.5 * 20000, err  # a real estimate, not noise
    assert "user-" not in (tmp_path / "releases" / "release-0.json").read_text()


def test_msgpack_stream_and_stdin_replay(tmp_path):
    items = np.random.default_rng(13).integers(0, D, 3000)
    stream = b"".join(msgpack.packb({"item": int(i)}) for i in items)
    path = tmp_path / "events.msgpack"
    path.write_bytes(stream + b"\x81\xa4ite")  # a truncated last record: one undecodable message
    args = cli_sets(tmp_path, path, **{"source.format": "msgpack", "release.on_exhausted": "false"})
    res = run_cli(args)
    assert res.returncode == 0, res.stderr
    counts, state, doc = live_counts_via_export(tmp_path)
    assert np.array_equal(counts, expected_noise() + np.bincount(items, minlength=D))
    assert doc["offsets"] == {"file:events.msgpack": 3001}
    # the same events from stdin, as JSON lines
    other = tmp_path / "second"
    args = cli_sets(other, "-", **{"release.on_exhausted": "true"})
    lines = "\n".join(json.dumps({"item": int(i)}) for i in items) + "\n"
    res = subprocess.run(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        input=lines,
        text=True,
        capture_output=True,
        timeout=120,
        env=dict(os.environ, PANAGG_TESTING="1"),
    )
    assert res.returncode == 0, res.stderr
    rel = json.loads((other / "releases" / "release-0.json").read_text())
    assert rel["n"] == 3000 and rel["histogram"] == expected_release(items, 0)["histogram"]
    assert durable(other).offsets == {"file:stdin": 3000}


def test_corrupt_checkpoint_stops_with_one_line(tmp_path):
    items = np.random.default_rng(14).integers(0, D, 1000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(tmp_path, path, **{"release.on_exhausted": "false"})
    assert run_cli(args).returncode == 0
    (ckpt_file,) = (tmp_path / "state" / "checkpoints").glob("checkpoint-*.ckpt")
    data = bytearray(ckpt_file.read_bytes())
    data[-100] ^= 0xFF
    ckpt_file.write_bytes(bytes(data))
    res = run_cli(args)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("panagg: error:")
    assert "checksum" in res.stderr or "not a readable checkpoint" in res.stderr
    assert "--fresh-start" in res.stderr and "Traceback" not in res.stderr


def test_unreachable_kafka_is_one_line(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            "127.0.0.1:1",
            "--topic",
            "x",
            "--state-dir",
            str(tmp_path / "s"),
            "--metrics-port",
            "-1",
            "--set",
            "source.connect_timeout_s=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr
    assert lines[-1] == (
        "panagg: error: cannot reach Kafka: connection refused at 127.0.0.1:1 "
        "(nothing listens on that port) for 2 s (source.connect_timeout_s). "
        "Check source.bootstrap and that the broker is running "
        "(deploy/kafka/kafka.sh start)"
    )
    assert "waiting up to 2 s for it (source.connect_timeout_s)" in res.stderr
    assert not any("ECONNREFUSED" in ln for ln in lines)  # no burst of client retries


def test_unresolvable_kafka_host_is_its_own_line(tmp_path):
    """A DNS failure and a refused port once both read KafkaTimeoutError after 30 s."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "aggregator.service.cli",
            "run",
            "--bootstrap",
            "no-such-host.invalid:9092",
            "--topic",
            "x",
            "--state-dir",
            str(tmp_path / "s"),
            "--metrics-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        "panagg: error: cannot reach Kafka: cannot resolve host 'no-such-host.invalid' (DNS). "
        "Check source.bootstrap and that the broker is running (deploy/kafka/kafka.sh start)"
    )
    assert "connecting to Kafka at no-such-host.invalid:9092" in res.stderr  # not silent


# -- the ledger is the authority; a state directory keeps its identity -----------------------------
def _three_windows(tmp_path, n=3000, **overrides):
    items = np.random.default_rng(15).integers(0, D, n)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    sets = {"window.size": 1000, "release.on_exhausted": "false", **overrides}
    return items, path, cli_sets(tmp_path, path, **sets)


def test_missing_checkpoint_with_a_ledger_is_refused_and_fresh_start_is_recorded(tmp_path):
    items, path, args = _three_windows(tmp_path, n=2500)
    assert run_cli(args).returncode == 0  # windows 0 and 1 released, window 2 open
    moved = tmp_path / "moved-away"
    (tmp_path / "state" / "checkpoints").rename(moved)
    res = run_cli(args)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"panagg: error: no checkpoint in {tmp_path / 'state' / 'checkpoints'}, but the ledger in "
        f"{tmp_path / 'state'} records 2 release(s): the checkpoint was lost or moved away. "
        "Restore it from a backup, or start with --fresh-start (the window it held is then "
        "never released)"
    )
    before = (tmp_path / "releases" / "release-0.json").read_bytes()
    fresh = run_cli(args + ["--fresh-start"])
    assert fresh.returncode == 0, fresh.stderr
    # numbering continues after the ledger's windows: nothing of the earlier run is overwritten
    assert (tmp_path / "releases" / "release-0.json").read_bytes() == before
    entries = ledger_entries(tmp_path)
    kinds = [(e["kind"], e["window"]) for e in entries]
    assert ("fresh-start", 2) in kinds
    # counting resumes after the last released position, never over released events again
    (fresh_entry,) = [e for e in entries if e["kind"] == "fresh-start"]
    part = f"file:{path.name}"
    assert fresh_entry["resume_offsets"] == {part: 2000}
    assert [w for k, w in kinds if k == "release"] == [0, 1]
    ckpt = durable(tmp_path)
    assert ckpt.window["id"] == 2 and ckpt.offsets == {part: 2000}
    assert ckpt.window["start_offsets"] == {part: 2000}
    # the window the lost checkpoint held is counted from where the releases ended: its events
    # (positions 2000-2499) are in no release yet
    counts, _, _ = live_counts_via_export(tmp_path)
    assert np.array_equal(counts, expected_state(items[2000:], 2).counts)


def test_a_rolled_back_checkpoint_is_refused(tmp_path):
    items, path, args = _three_windows(tmp_path, n=1500)
    assert run_cli(args).returncode == 0  # window 0 released; window 1 open
    old = next((tmp_path / "state" / "checkpoints").glob("*.ckpt")).read_bytes()
    more = np.random.default_rng(16).integers(0, D, 1500)
    with open(path, "a") as f:
        f.write("\n".join(json.dumps({"item": int(i)}) for i in more) + "\n")
    assert run_cli(args).returncode == 0  # windows 1 and 2 released
    ckpt_dir = tmp_path / "state" / "checkpoints"
    for f in ckpt_dir.glob("*.ckpt"):
        f.unlink()
    (ckpt_dir / "checkpoint-000000000001.ckpt").write_bytes(old)  # an older valid backup
    res = run_cli(args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "is older than the ledger: it is at window 1, the ledger has window 2 released"
        in res.stderr.strip().splitlines()[-1]
    )
    assert len(list((tmp_path / "releases").glob("*.json"))) == 3


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (
            lambda lines: lines[:1] + ['{"id": "release-x", "kind": "release"'] + lines[1:],
            "line 2 is not a JSON entry",
        ),
        (
            lambda lines: (
                lines[:1]
                + ['{"id": "r", "kind": "release", "window": 0, "time_unix": 1}']
                + lines[1:]
            ),
            "line 2 has no 'epsilon_spent'",
        ),
    ],
)
def test_a_damaged_ledger_stops_with_the_line_number(tmp_path, damage, fragment):
    items, path, args = _three_windows(tmp_path)
    assert run_cli(args).returncode == 0
    ledger = tmp_path / "state" / "ledger.jsonl"
    ledger.write_text("\n".join(damage(ledger.read_text().splitlines())) + "\n")
    res = run_cli(args)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"panagg: error: ledger {ledger} {fragment}; ")
    assert "restore the file from a backup" in line


def test_a_torn_last_ledger_line_is_cut_off_and_redone(tmp_path):
    from aggregator.service.ledger import Ledger

    path = tmp_path / "ledger.jsonl"
    led = Ledger(path, budget_per_window=1.0)
    led.append(entry_id="a", kind="release", window=0, epsilon_spent=1.0)
    with open(path, "ab") as f:
        f.write(b'{"id": "b", "kind": "rel')  # a crash in the middle of the next append
    led = Ledger(path, budget_per_window=1.0)
    assert [e["id"] for e in led.entries] == ["a"]
    led.append(entry_id="b", kind="release", window=1, epsilon_spent=1.0)
    assert [e["id"] for e in Ledger(path, budget_per_window=1.0).entries] == ["a", "b"]


def test_other_settings_on_a_state_dir_are_refused_or_recorded(tmp_path):
    items, path, args = _three_windows(tmp_path, n=500)
    assert run_cli(args).returncode == 0
    res = run_cli(args + ["--set", "ledger.budget_total=0.5"])
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"panagg: error: checkpoint.dir {tmp_path / 'state'} belongs to other settings "
        "(budget_total 0.0 -> 0.5); use the original settings, a new checkpoint.dir, or "
        "--accept-change to record the change in the ledger"
    )
    ok = run_cli(args + ["--set", "ledger.budget_total=0.5", "--accept-change"])
    assert ok.returncode == 0, ok.stderr
    (change,) = [e for e in ledger_entries(tmp_path) if e["kind"] == "identity" and "previous" in e]
    assert change["previous"]["budget_total"] == 0.0 and change["identity"]["budget_total"] == 0.5


def test_refused_windows_are_ledgered_before_any_noise_and_never_recomputed(tmp_path):
    items, path, args = _three_windows(tmp_path, **{"ledger.budget_total": 1.0})
    assert run_cli(args).returncode == 0
    entries = ledger_entries(tmp_path)
    assert [e["kind"] for e in entries] == ["identity", "release", "refused", "refused"]
    assert sum(e["epsilon_spent"] for e in entries) == 1.0
    assert [p.name for p in (tmp_path / "releases").glob("*.json")] == ["release-0.json"]


def test_reject_totals_are_exact_across_restarts(tmp_path):
    """Per-reason reject totals live in the checkpoint with the offsets: a crash and a replay
    neither reset nor double them."""
    items = np.random.default_rng(17).integers(0, D, 5000)
    path = tmp_path / "events.jsonl"
    bad = [(k * 300, "not json") for k in range(1, 11)]
    write_events(path, items, bad)
    args = cli_sets(tmp_path, path, **{"window.size": 2000, "release.on_exhausted": "false"})
    first = run_cli(args, {"PANAGG_TEST_FAULT": "checkpoint-after-rename:3"})
    assert first.returncode == -9
    assert run_cli(args).returncode == 0
    assert run_cli(args).returncode == 0  # a restart with nothing new
    ckpt = durable(tmp_path)
    # windows 0 and 1 closed; window 2 is open (replayed at every start, never in the totals)
    assert ckpt.window["id"] == 2 and ckpt.totals["events"] == 4000
    bad_before = sum(1 for pos, _ in bad if pos < ckpt.offsets[f"file:{path.name}"])
    assert ckpt.totals["rejects"] == {"undecodable": bad_before}


def test_a_release_file_of_another_run_is_never_overwritten(tmp_path):
    items = np.random.default_rng(18).integers(0, D, 1000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    first = run_cli(cli_sets(tmp_path, path, **{"window.size": 1000}))
    assert first.returncode == 0, first.stderr
    kept = (tmp_path / "releases" / "release-0.json").read_bytes()
    # (outside the budget registry, which would rightly start it after the released records:
    # the clash of release files is the subject here)
    other = cli_sets(
        tmp_path,
        path,
        **{
            "window.size": 1000,
            "ledger.file_registry": "",
            "checkpoint.dir": tmp_path / "other-state",
        },
    )
    second = run_cli(other)  # another state directory, the same release directory
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert second.stderr.strip().splitlines()[-1] == (
        "panagg: error: 1 release(s) could not be published (window 0: a different release is "
        f"already in this file (another run or state directory wrote it); publish to a new "
        f"release directory or release name: {tmp_path / 'releases' / 'release-0.json'}); they "
        "stay in the checkpoint and are published at the next start once the cause is fixed"
    )
    assert (tmp_path / "releases" / "release-0.json").read_bytes() == kept
    # the same document again (a re-publish after a crash) is not an overwrite
    from aggregator.release import write_release

    write_release(json.loads(kept), tmp_path / "releases", plot=False)


@pytest.mark.parametrize("command", [["release"], ["audit", "export"]])
def test_offline_commands_refuse_a_directory_without_state(tmp_path, command):
    typo = tmp_path / "no-such-state"
    res = run_cli([*command, "--state-dir", str(typo)], {"PANAGG_AUDIT_KEY": KEY_HEX})
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"panagg: error: {typo} holds no panagg state (no checkpoints/ directory); pass the "
        "--state-dir the service runs with"
    )
    assert not typo.exists() and not (tmp_path / "releases").exists()


@pytest.mark.parametrize(
    "sets, content, fix",
    [
        (
            {"source.format": "msgpack"},
            [json.dumps({"item": i % D}) for i in range(300)],
            "the records look like JSON: set source.format = json",
        ),
        (
            {},
            [json.dumps({"item": f"user-{i}"}) for i in range(300)],
            "direct mode counts ints in [0, state.domain_size); for string or bytes items set "
            "state.mode = hashed",
        ),
    ],
)
def test_a_run_that_rejects_everything_says_why_and_fails(tmp_path, sets, content, fix):
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(content) + "\n")
    res = run_cli(cli_sets(tmp_path, path, **sets))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("panagg: error: ") and last.endswith(fix), last
    # said as soon as the first records showed it, too, as one error line (never a payload)
    assert sum(fix in line for line in res.stderr.splitlines()) == 2
    assert "user-1" not in res.stderr


def test_healthz_and_ready_endpoints_of_a_running_service(tmp_path):
    import time as _time
    import urllib.error
    import urllib.request

    args = [
        "run",
        "--set",
        "source.kind=generator",
        "--set",
        "source.generator_events=100000",
        "--set",
        "source.generator_rate=2000",
        "--set",
        "source.max_records=200",
        "--set",
        f"state.domain_size={D}",
        "--set",
        "window.size=1000000",
        "--state-dir",
        str(tmp_path / "state"),
        "--release-dir",
        str(tmp_path / "releases"),
        "--metrics-port",
        "0",
        "--set",
        "release.on_exhausted=false",
    ]
    log_path = tmp_path / "service.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aggregator.service.cli", *args],
        env=dict(os.environ, PANAGG_TESTING="1"),
        stderr=open(log_path, "w"),
    )
    try:
        base = None
        deadline = _time.time() + 60
        while base is None and _time.time() < deadline:
            for line in log_path.read_text().splitlines():
                if line.startswith("metrics on "):
                    base = line.split()[-1].rsplit("/", 1)[0]
            _time.sleep(0.2)
        assert base, log_path.read_text()

        def get(path):
            try:
                with urllib.request.urlopen(base + path, timeout=5) as r:
                    return r.status, r.read().decode()
            except urllib.error.HTTPError as e:
                return e.code, e.read().decode()

        deadline = _time.time() + 30
        while get("/ready")[0] != 200 and _time.time() < deadline:
            _time.sleep(0.2)
        assert get("/healthz") == (200, "ok\n")
        assert get("/ready") == (200, "ready\n")
        status, text = get("/metrics")
        assert status == 200 and "panagg_events_total" in text
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert proc.returncode == 0, log_path.read_text()[-2000:]


def test_health_says_stuck_and_not_ready_with_a_reason():
    from aggregator.service.metrics import Metrics

    m = Metrics()
    assert m.health()[0] == 503 and m.readiness() == (503, "not ready: starting\n")
    m.heartbeat()
    m.set_ready(False, "Kafka broker unreachable")
    assert m.health() == (200, "ok\n")
    assert m.readiness() == (503, "not ready: Kafka broker unreachable\n")
    m._heartbeat -= 120
    assert m.health()[0] == 503 and "stuck" in m.health()[1]


def test_ledger_show_lists_releases_refusals_and_what_is_spent(tmp_path):
    items, path, args = _three_windows(tmp_path, **{"ledger.budget_total": 2.0})
    assert run_cli(args).returncode == 0
    res = run_cli(["ledger", "show", "--state-dir", str(tmp_path / "state")])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == (
        f"ledger {tmp_path / 'state' / 'ledger.jsonl'}: 4 entries; epsilon spent 2 "
        "of budget_total 2"
    )
    kinds = [ln.split()[2] for ln in lines[1:-1]]
    assert kinds == ["identity", "release", "release", "refused"]
    assert "n=1000 distinct=" in lines[2] and "budget_total=2" in lines[4]
    assert f"positions file:{path.name} [1000, 2000)" in lines[3]
    assert lines[-1].startswith("head: entry 4, sha256 ") and "chain verifies" in lines[-1]
    as_json = json.loads(
        run_cli(["ledger", "show", "--state-dir", str(tmp_path / "state"), "--json"]).stdout
    )
    assert [e["kind"] for e in as_json["entries"]] == kinds
    assert all("document" not in e for e in as_json["entries"])
    missing = run_cli(["ledger", "show", "--state-dir", str(tmp_path / "nope")])
    assert missing.returncode == 2 and "holds no ledger" in missing.stderr


def test_a_decoder_failure_on_one_message_makes_it_a_reject_not_a_crash(monkeypatch):
    decoder = Decoder("json", domain_size=D)
    real = decoder.decode_one

    def flaky(raw):
        if raw == b"boom":
            raise RuntimeError("a decoder bug")
        return real(raw)

    monkeypatch.setattr(decoder, "decode_one", flaky)
    out = decoder.decode([b'{"item": 1}', b"boom", b'{"item": 2}'])
    assert out.items == [1, 2] and out.rejected == [(1, "undecodable")]
