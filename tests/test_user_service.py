"""``state.privacy_unit = "user"`` in the one-process service (aggregator/service/user_window.py):
real login files, the real service in a subprocess (as tests/test_service.py runs it).

* distinct users per window within the stated 90 % intervals, over many windows;
* a kill -9 at the close and a restart: each window released once, the ledger's ranges tile the
  file and each release's n is its range (the exactly-once invariant of check_exact in
  tests/integration/test_group_kafka.py, on a file);
* refused combinations: one line, no directory;
* an intruder's read of everything on disk and in the log: no user id, no exact distinct count.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bench.service.user_windows import WINDOW, write_logins
from tests.helpers.service import run_cli
from tests.helpers.user import ledger, releases, user_args


def check_exact(tmp_path, total: int, eps: float = 1.0) -> dict[int, dict]:
    """Each window released once, consecutively; the ledger holds one release per window whose
    ranges tile [0, total) of the file, n = the range's length = the document's n, each charged
    eps; the published document is the ledgered one."""
    docs = releases(tmp_path)
    windows = sorted(docs)
    assert windows == list(range(len(windows))), windows
    entries = [e for e in ledger(tmp_path) if e["kind"] == "release"]
    assert [e["window"] for e in entries] == windows, "a window ledgered twice or missing"
    at = 0
    for e in entries:
        ((part, (a, b)),) = e["ranges"].items()
        assert a == at, f"window {e['window']}: ranges leave a gap or overlap"
        assert b - a == e["n"] == docs[e["window"]]["n"]
        assert e["epsilon_spent"] == eps
        assert json.loads(e["document"]) == docs[e["window"]]
        at = b
    assert at == total
    return docs


def test_distinct_users_within_their_intervals_over_many_windows(tmp_path):
    path = tmp_path / "logins.jsonl"
    truth = write_logins(path, 24)
    res = run_cli(user_args(tmp_path, path))
    assert res.returncode == 0, res.stderr
    docs = check_exact(tmp_path, 24 * WINDOW)
    inside, rel_err, stated = 0, [], []
    for w, users in enumerate(truth):
        doc = docs[w]
        assert doc["privacy_unit"] == doc["headline"]["privacy_unit"] == "user"
        d = doc["distinct_users"]
        lo, hi = d["interval"]
        inside += lo <= users <= hi
        rel_err.append((d["value"] - users) / users)
        stated.append(d["expected_relative_error"])
        assert doc["interval_level"] == 0.9 and 0.05 < d["expected_relative_error"] < 0.3
    # 24 windows at 90 %: 18 or more inside fails with probability ~0.4 %
    assert inside >= 18, (inside, rel_err)
    rms = float(np.sqrt(np.mean(np.square(rel_err))))
    assert 0.5 < rms / float(np.mean(stated)) < 1.6, (rms, np.mean(stated))
    assert "privacy unit: the user" in res.stderr  # the start line says the unit


def test_active_fraction_and_status_say_the_unit(tmp_path):
    path = tmp_path / "logins.jsonl"
    truth = write_logins(path, 2, seed=11)
    res = run_cli(user_args(tmp_path, path, **{"state.user_universe": 10000}))
    assert res.returncode == 0, res.stderr
    doc = releases(tmp_path)[0]
    frac = doc["active_fraction"]
    assert frac["value"] == pytest.approx(doc["distinct_users"]["value"] / 10000)
    assert abs(frac["value"] - truth[0] / 10000) < 0.15
    status = run_cli(["status", "--state-dir", str(tmp_path / "state")])
    assert status.returncode == 0, status.stderr
    assert "privacy unit: the user" in status.stdout and "distinct users" in status.stdout
    assert (
        "per-user budget: eps 2 of 100 charged to every user by this ledger (98 more window(s)"
    ) in status.stdout
    plan = run_cli(
        [
            "plan",
            "--set",
            "state.privacy_unit=user",
            "--set",
            "state.expected_users=2000",
            "--set",
            "ledger.budget_per_user=30",
        ]
    )
    assert plan.returncode == 0 and "privacy unit: the user" in plan.stdout
    assert "at 2,000 users" in plan.stdout
    assert "per-user budget 30 eps (ledger.budget_per_user): 30 released windows" in plan.stdout


@pytest.mark.parametrize(
    "fault", ["checkpoint-mid-write:3", "checkpoint-after-rename:2", "checkpoint-before-rename:4"]
)
def test_kill_at_the_close_and_restart_releases_each_window_once(tmp_path, fault):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 4, seed=5)
    args = user_args(tmp_path, path)
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault})
    assert first.returncode == -9, first.stderr  # SIGKILLed at the fault point
    ledgered = {e["window"]: e["document"] for e in ledger(tmp_path) if e["kind"] == "release"}
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    docs = check_exact(tmp_path, 4 * WINDOW)
    for w, doc in ledgered.items():  # re-published from the ledger, never drawn again
        assert docs[w] == json.loads(doc)


def test_time_windows_release_users_exactly_once(tmp_path):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 2, seed=3)
    res = run_cli(
        user_args(
            tmp_path,
            path,
            **{"window.kind": "time", "window.size": 3600, "release.on_exhausted": "true"},
        )
    )
    assert res.returncode == 0, res.stderr
    docs = check_exact(tmp_path, 2 * WINDOW)
    assert all(
        d["privacy_unit"] == "user" and d["window_info"]["kind"] == "time" for d in docs.values()
    )


@pytest.mark.parametrize(
    "sets",
    [
        ["scale.partitioned=true", "source.kind=kafka", "source.topic=t"],
        [
            "window.rollups=1d",
            "window.kind=time",
            "window.size=3600",
            "window.rollup_design=sum",
            "state.rollup_expected_users=20000",
        ],
        ["window.rollups=1d", "window.kind=time", "window.size=3600"],
        ["state.model=shuffle"],
        ["state.mode=hashed"],
        ["checkpoint.snapshots_per_window=1"],
        ["breakdown.field=country"],
        ["state.expected_users=0"],
    ],
    ids=[
        "scale-out",
        "summed rollups",
        "rollups without their users",
        "shuffle",
        "hashed",
        "snapshots",
        "breakdown",
        "no expected users",
    ],
)
def test_unsupported_combinations_are_one_line_and_write_nothing(tmp_path, sets):
    path = tmp_path / "logins.jsonl"
    path.write_text(json.dumps({"user": "alice"}) + "\n")
    args = user_args(tmp_path, path)
    for one in sets:
        args += ["--set", one]
    res = run_cli(args)
    assert res.returncode != 0
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "state.privacy_unit = user" in lines[0], res.stderr
    assert not (tmp_path / "state").exists() and not (tmp_path / "releases").exists()


def test_an_intruder_reads_no_user_and_no_exact_count_on_disk_or_in_the_log(tmp_path):
    path = tmp_path / "logins.jsonl"
    truth = write_logins(path, 3, seed=13)
    # the third window is cut by a kill -9 inside its close: its state was live at the kill
    res = run_cli(user_args(tmp_path, path), {"PANAGG_TEST_FAULT": "checkpoint-mid-write:4"})
    assert res.returncode == -9
    logs = res.stderr
    res = run_cli(user_args(tmp_path, path))
    assert res.returncode == 0, res.stderr
    logs += res.stderr
    seen = (
        b"".join(p.read_bytes() for p in sorted((tmp_path / "state").rglob("*")) if p.is_file())
        + logs.encode()
    )
    assert b"alice-" not in seen  # no user id anywhere
    # no window's exact distinct users (odd: never an offset or a size), as a number anywhere
    # but in the released noisy count of 1-bits (a release: it may equal anything)
    seen = re.sub(rb'noisy_ones\\?": -?\d+', b"", seen)
    for users in truth:
        assert not re.search(rb"(?<![0-9A-Za-z.])%d(?![0-9A-Za-z.])" % users, seen), users
    assert list((tmp_path / "state" / "checkpoints").iterdir())


def test_an_audit_export_is_refused_in_one_line_and_ledgers_nothing(tmp_path):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 1, seed=17)
    assert run_cli(user_args(tmp_path, path)).returncode == 0
    before = (tmp_path / "state" / "ledger.jsonl").read_bytes()
    res = run_cli(
        ["audit", "export", "--state-dir", str(tmp_path / "state")],
        {"PANAGG_AUDIT_KEY": "00ff" * 16},
    )
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0, res.stderr
    assert "audit export of a user-level density state is refused" in res.stderr
    assert (tmp_path / "state" / "ledger.jsonl").read_bytes() == before


def test_the_user_unit_inside_an_aggregation_table_is_refused(tmp_path):
    """[aggregations.NAME] may set state.*: the user unit there is refused as it is beside them
    at the top level (not run by a service that does not wire it)."""
    from aggregator.service.config import ConfigError, load_config

    sets = [
        "source.kind=file",
        f"source.path={tmp_path / 'x.jsonl'}",
        "ledger.budget_per_event=2",
        "aggregations.a.item.field=user",
        "aggregations.a.state.privacy_unit=user",
        "aggregations.a.state.expected_users=100",
        "aggregations.b.item.field=ip",
    ]
    with pytest.raises(
        ConfigError,
        match=r"^aggregations\.a: state\.privacy_unit = user is not "
        r"built with several aggregations",
    ):
        load_config(None, sets, env={})
    load_config(None, [s for s in sets if "privacy_unit" not in s], env={})  # the rest is fine
