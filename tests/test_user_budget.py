"""``ledger.budget_per_user``: under ``state.privacy_unit = "user"`` the ledger bounds what one user
is charged over every window (aggregator/service/user_budget.py), not only what one source
position is. Real login files, the real service in a subprocess (tests/test_user_service.py's
helpers).

* the budget reached after N windows: window N+1 refused in one line, ledgered as refused, no
  document; with a budget one window larger every window is released (the control);
* a restart counts: a window replayed after a kill is charged twice;
* another deployment's user-level releases on the same content count (the file registry), and
  in a cluster's registry those on the same topic or a --same-records-as one, not another topic;
* the setting missing, below one window's eps, or set under the event unit: one line, nothing
  written;
* an endless source pauses its intake once the budget cannot pay for a window.

Negative control: before the per-user budget, every window of these runs was released (the
per-event check passes disjoint positions forever), and the setting did not exist.
"""

from __future__ import annotations

import json

import pytest

from bench.service.user_windows import WINDOW, write_logins
from tests.helpers.service import pause_line_said_once, run_cli
from tests.helpers.user import ledger, releases, user_args

SPENT = "the per-user budget is spent"


def refusal_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if SPENT in x]


def test_the_budget_reached_after_n_windows_refuses_the_next_in_one_line(tmp_path):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 4, seed=7)
    res = run_cli(user_args(tmp_path, path, **{"ledger.budget_per_user": 3}))
    assert res.returncode == 0, res.stderr
    assert sorted(releases(tmp_path)) == [0, 1, 2]  # window 3 is not published
    lines = refusal_lines(res.stderr)
    assert len(lines) == 1 and "release of window 3 refused" in lines[0], res.stderr
    assert "charged 4 eps > ledger.budget_per_user = 3" in lines[0]
    assert "Fix: raise ledger.budget_per_user" in lines[0]
    entries = ledger(tmp_path)
    rel = [e for e in entries if e["kind"] == "release"]
    assert [e["user_epsilon"] for e in rel] == [1.0, 1.0, 1.0]
    assert {e["user_stream"] for e in rel} == {rel[0]["user_stream"]}
    refused = [e for e in entries if e["kind"] == "refused"]
    assert [e["window"] for e in refused] == [3] and refused[0]["epsilon_spent"] == 0
    assert SPENT in refused[0]["note"] and "user_epsilon" not in refused[0]
    # each document says what every user has spent with it and what is left
    docs = releases(tmp_path)
    assert [docs[w]["per_user_budget"]["windows_left"] for w in range(3)] == [2, 1, 0]
    assert docs[2]["per_user_budget"] == {
        "budget_per_user": 3.0,
        "spent": 3.0,
        "this_release": 1.0,
        "windows_left": 0,
    }
    assert "per-user budget: 0 of ledger.budget_per_user=3 eps" in res.stderr  # the start line

    # raising it is a policy change: refused without --accept-change, recorded with it
    raised = user_args(tmp_path, path, **{"ledger.budget_per_user": 5})
    res = run_cli(raised)
    assert res.returncode != 0 and "budget_per_user 3.0 -> 5.0" in res.stderr, res.stderr
    assert run_cli([*raised, "--accept-change"]).returncode == 0
    changed = [e for e in ledger(tmp_path) if e["kind"] == "identity"][-1]
    assert changed["identity"]["budget_per_user"] == 5.0
    assert changed["previous"]["budget_per_user"] == 3.0

    # the control: one window more of budget, every window released
    control = tmp_path / "control"
    control.mkdir()
    res = run_cli(
        user_args(control, path, **{"ledger.budget_per_user": 4, "ledger.file_registry": ""})
    )
    assert res.returncode == 0, res.stderr
    assert sorted(releases(control)) == [0, 1, 2, 3] and not refusal_lines(res.stderr)


def test_a_window_replayed_after_a_kill_is_charged_twice(tmp_path):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 3, seed=9)
    args = user_args(tmp_path, path, **{"ledger.budget_per_user": 3})
    # killed with window 1's release drawn, not ledgered: its bits were in memory, full
    first = run_cli(args, {"PANAGG_TEST_FAULT": "ledger-before-release:2"})
    assert first.returncode == -9, first.stderr
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    entries = ledger(tmp_path)
    restarts = [e for e in entries if e["kind"] == "restart"]
    assert [e["window"] for e in restarts] == [1]
    rel = {e["window"]: e for e in entries if e["kind"] == "release"}
    assert sorted(rel) == [0, 1]
    assert rel[0]["user_epsilon"] == 1.0 and rel[1]["user_epsilon"] == 2.0
    assert rel[1]["epsilon_spent"] == 1.0  # (positions: still one release each)
    lines = refusal_lines(second.stderr)
    assert len(lines) == 1 and "release of window 2 refused" in lines[0], second.stderr
    assert [e["window"] for e in entries if e["kind"] == "refused"] == [2]
    assert sorted(releases(tmp_path)) == [0, 1]
    assert releases(tmp_path)[1]["per_user_budget"]["this_release"] == 2.0


def test_another_deployments_user_releases_on_the_same_content_count(tmp_path):
    """A file grown by appends, read from a new state directory: the per-event check lets the
    new positions through, the per-user budget counts the first directory's releases (the file
    registry, keyed by content)."""
    full = tmp_path / "all.jsonl"
    write_logins(full, 4, seed=21)
    lines = full.read_text().splitlines(keepends=True)
    path = tmp_path / "logins.jsonl"
    path.write_text("".join(lines[: 2 * WINDOW]))
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    res = run_cli(user_args(first, path, **{"ledger.budget_per_user": 3}))
    assert res.returncode == 0, res.stderr
    assert sorted(releases(first)) == [0, 1]
    path.write_text("".join(lines))  # two more windows appended
    res = run_cli(user_args(second, path, **{"ledger.budget_per_user": 3}))
    assert res.returncode == 0, res.stderr
    assert "was read and released before" in res.stderr  # it starts after the first's positions
    assert sorted(releases(second)) == [0]  # 2 by the first directory + 1 = 3
    refusal = refusal_lines(res.stderr)
    assert len(refusal) == 1 and "release of window 1 refused" in refusal[0], res.stderr
    assert "other deployments on this stream 2 (the budget registry)" in refusal[0]
    assert "per-user budget: 2 of ledger.budget_per_user=3" in res.stderr  # the start line


@pytest.mark.parametrize(
    "sets, says",
    [
        ({"ledger.budget_per_user": 0}, "needs ledger.budget_per_user"),
        ({"ledger.budget_per_user": 0.5}, "ledger.budget_per_user 0.5 is below one window's"),
        ({"ledger.budget_per_user": -1}, "ledger.budget_per_user must be >= 0"),
        (
            {"state.privacy_unit": "event", "state.domain_size": 100},
            "bounds users under state.privacy_unit = user only",
        ),
    ],
    ids=["missing", "below a window", "negative", "event unit"],
)
def test_a_missing_or_wrong_budget_is_one_line_and_writes_nothing(tmp_path, sets, says):
    path = tmp_path / "logins.jsonl"
    path.write_text(json.dumps({"user": "alice"}) + "\n")
    res = run_cli(user_args(tmp_path, path, **sets))
    assert res.returncode != 0
    out = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(out) == 1 and says in out[0], res.stderr
    assert not (tmp_path / "state").exists() and not (tmp_path / "releases").exists()


def test_a_spent_budget_pauses_an_endless_source(tmp_path, caplog, monkeypatch):
    """Kafka runs do not end: once the budget cannot pay for a window the loop stops consuming
    (no user's bits are held for a window that would be refused), says so once, is not ready."""
    from aggregator.service.config import load_config

    monkeypatch.setenv("PANAGG_TESTING", "1")
    path = tmp_path / "logins.jsonl"
    write_logins(path, 2, seed=23)
    args = user_args(tmp_path, path, **{"ledger.budget_per_user": 2})
    cfg = load_config(None, [a for a in args[1:] if a != "--set"])
    assert run_cli(args).returncode == 0
    agg, line = pause_line_said_once(cfg, path, caplog)
    assert line.startswith(
        "per-user budget spent: 2 of ledger.budget_per_user=2 leaves 0 < 1 for a window, so "
        "intake is paused"
    ), line
    assert agg.metrics.readiness()[0] == 503
    # the gauges PanaggUserBudgetSpent reads (deploy/prometheus/alerts.yml)
    reg = agg.metrics.registry
    assert reg.get_sample_value("panagg_user_budget_spent_epsilon") == 2.0
    assert reg.get_sample_value("panagg_user_budget_remaining_epsilon") == 0.0
    assert reg.get_sample_value("panagg_epsilon") == 1.0
    agg.close()


def test_the_registry_counts_user_releases_of_the_same_stream_only(tmp_path):
    """The gate with a budget registry (in memory, as a Kafka cluster's would hold it): another
    deployment's user-level releases on the same topic count, on a topic whose records this one
    holds copies of (--same-records-as) too, on another topic not; this ledger's own charges in
    the registry are not counted twice."""
    from aggregator.service.ledger import Ledger
    from aggregator.service.metrics import Metrics
    from aggregator.service.release_gate import ReleaseGate
    from aggregator.service.user_budget import UserBudget
    from state_store.registry import MemoryRegistry, ledger_id

    class Cluster(MemoryRegistry):  # the topic's records, read already
        topic = "panagg.budget"

        def read_to_end(self, timeout_s=None):
            pass

    reg = Cluster({"state_dir": "/srv/other"})
    for entry_id, topic in (
        ("release-a", "logins"),
        ("release-b", "eu"),
        ("release-c", "logins-old"),
    ):
        reg.record(
            "L-other",
            {
                "id": entry_id,
                "kind": "release",
                "epsilon_spent": 1.0,
                "ranges": {f"{topic}:0": [0, 10]},
                "lineage": "x",
                "user_epsilon": 1.0,
                "user_stream": f"kafka:{topic}",
            },
        )
    ledger = Ledger(tmp_path / "ledger.jsonl", budget_per_window=1.0)
    gate = ReleaseGate(
        ledger,
        Metrics(),
        epsilon=1.0,
        model="joint",
        stream="kafka:logins",
        aggregation="",
        directory=tmp_path,
    )
    gate.user_budget = UserBudget(ledger, budget=2.0, epsilon=1.0)
    gate.attach_registry(reg)
    window = {"events": 10, "lineage": "L1", "kind": "count"}

    def release(uid, wid, ranges):
        assert gate.allows(uid, wid, ranges=ranges, charge=1.0, closing=window)
        ledger.append(
            entry_id=f"release-{uid}",
            kind="release",
            window=wid,
            window_uid=uid,
            epsilon_spent=1.0,
            document="{}",
            ranges=ranges,
            lineage="L1",
            window_kind="count",
            **gate.user_charge_fields(uid, 1.0),
        )

    release("u0", 0, {"logins:0": [100, 200]})  # the other's 1 on logins + 1 = 2
    mine = reg.records[f"{ledger_id(ledger.entries)}/release-u0"]  # (not counted twice)
    assert mine["user_epsilon"] == 1.0 and mine["user_stream"] == "kafka:logins"
    assert not gate.allows("u1", 1, ranges={"logins:0": [200, 300]}, charge=1.0, closing=window)
    note = ledger.get("refused-u1")["note"]
    assert "charged 3 eps > ledger.budget_per_user = 2" in note
    assert "other deployments on this stream 1 (the budget registry)" in note
    # the operator says logins holds copies of logins-old: its users' releases count too
    ledger.append(
        entry_id="identity-copy",
        kind="identity",
        identity={},
        same_records_as={"from": "logins-old", "to": "logins"},
    )
    assert sorted(c["entry"] for c in gate.user_charges_elsewhere()) == ["release-a", "release-c"]


def test_the_per_user_gauges_are_set_at_the_start(tmp_path, monkeypatch):
    """A restart shows what every user has spent from its first turn (before any release of its
    own): the gauges follow the ledger at the start, not only after a release."""
    from aggregator.service import Aggregator
    from aggregator.service.config import load_config
    from consumers.file_source import FileSource

    monkeypatch.setenv("PANAGG_TESTING", "1")
    path = tmp_path / "logins.jsonl"
    write_logins(path, 2, seed=29)
    args = user_args(tmp_path, path, **{"ledger.budget_per_user": 5})
    assert run_cli(args).returncode == 0
    cfg = load_config(None, [a for a in args[1:] if a != "--set"])
    agg = Aggregator(cfg, FileSource(str(path), "json", batch=1000, progress=False))
    reg = agg.metrics.registry
    assert reg.get_sample_value("panagg_user_budget_remaining_epsilon") == float("inf")
    agg.run()  # the file was read to its end by the first run: nothing more is released
    assert reg.get_sample_value("panagg_user_budget_spent_epsilon") == 2.0
    assert reg.get_sample_value("panagg_user_budget_remaining_epsilon") == 3.0
