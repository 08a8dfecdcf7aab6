"""User-level rollups (``window.rollups`` under ``state.privacy_unit = "user"``): each span a
density state of its own, fed by the same records as the base windows (a level of its own:
``checkpoint.dir/r<span>``, ``release.dir/r<span>``), released at ``state.epsilon`` and
charged to every user beside the base windows (``ledger.budget_per_user`` over both levels'
ledgers). The real service in a subprocess, on the login files of tests/test_user_service.py.

* a span's distinct users from its one state, within its interval, with its document;
* the per-user budget counts both levels and refuses the release that would pass it;
* a kill -9 at the close (of either level) and a restart: every window of each level released
  once, the ledgers' ranges tile the file, the replayed window charged twice;
* the start line and ``panagg plan`` say what one span costs a user.
"""

from __future__ import annotations

import json

import pytest

from bench.service.user_windows import WINDOW, write_logins
from tests.helpers.service import run_cli
from tests.helpers.user import user_args

SPAN = 4 * WINDOW  # a rollup of 4 base windows (count windows: a number of events)
LEVELS = ("base", f"r{SPAN}")


def rollup_args(tmp_path, path, **overrides):
    sets = {
        "window.rollups": SPAN,
        "state.rollup_expected_users": 9000,
        "source.max_records": 1500,
        "ledger.file_registry": tmp_path / "registry.jsonl",
    }
    sets.update(overrides)
    return user_args(tmp_path, path, **sets)


def level_docs(tmp_path, level) -> dict[int, dict]:
    out = {}
    for f in (tmp_path / "releases" / level).glob("release-*.json"):
        doc = json.loads(f.read_text())
        out[doc["window"]] = doc
    return out


def level_ledger(tmp_path, level) -> list[dict]:
    text = (tmp_path / "state" / level / "ledger.jsonl").read_text()
    return [json.loads(x) for x in text.splitlines()]


def check_level(tmp_path, level, size, total) -> dict[int, dict]:
    """Each window of ``level`` released once, in order; its ledger's ranges tile [0, total)
    with n = the range = the document's n; the published document is the ledgered one."""
    docs = level_docs(tmp_path, level)
    windows = sorted(docs)
    assert windows == list(range(total // size)), (level, windows)
    entries = [e for e in level_ledger(tmp_path, level) if e["kind"] == "release"]
    assert [e["window"] for e in entries] == windows, f"{level}: a window ledgered twice"
    at = 0
    for e in entries:
        ((_, (a, b)),) = e["ranges"].items()
        assert a == at and b - a == e["n"] == docs[e["window"]]["n"] == size, (level, e)
        assert json.loads(e["document"]) == docs[e["window"]]
        at = b
    assert at == total
    return docs


def user_charges(tmp_path) -> float:
    return sum(
        float(e.get("user_epsilon") or 0) for level in LEVELS for e in level_ledger(tmp_path, level)
    )


def test_a_span_is_one_state_released_with_its_document_and_charged_per_user(tmp_path):
    path = tmp_path / "logins.jsonl"
    truth = write_logins(path, 8, seed=5)  # each base window has users of its own
    res = run_cli(rollup_args(tmp_path, path))
    assert res.returncode == 0, res.stderr
    check_level(tmp_path, "base", WINDOW, 8 * WINDOW)
    spans = check_level(tmp_path, LEVELS[1], SPAN, 8 * WINDOW)
    for w, doc in spans.items():
        users = sum(truth[4 * w : 4 * w + 4])  # (no user in two base windows: their sum)
        d = doc["distinct_users"]
        assert doc["privacy_unit"] == "user" and doc["mechanism"] == "density"
        assert doc["n"] == SPAN and doc["epsilon"] == 1.0
        assert doc["rollup_level"]["design"] == "user"
        assert doc["rollup_level"]["base_windows"] == 4
        assert doc["density"]["cells"] > 2 * 9000  # sized for the span's users, not a window's
        # (the 90 % interval's coverage is a rate, measured in docs/privacy_unit.md; asserted
        # per span here it failed a full suite once: 9,254 users, interval [7,540, 9,230]. The
        # estimate's distance in stated errors is what a test can hold)
        assert d["interval"][0] <= d["value"] <= d["interval"][1], d
        assert abs(d["value"] - users) / users < 4 * d["expected_relative_error"], (users, d)
    # every release of either level charged every user eps 1: 8 + 2
    assert user_charges(tmp_path) == 10.0
    last = max(
        (doc for level in LEVELS for doc in level_docs(tmp_path, level).values()),
        key=lambda doc: doc["per_user_budget"]["spent"],
    )
    assert last["per_user_budget"]["spent"] == 10.0
    # panagg status of either level counts both ledgers
    status = run_cli(["status", "--state-dir", str(tmp_path / "state" / LEVELS[1])])
    assert status.returncode == 0, status.stderr
    assert (
        "per-user budget: eps 10 of 100 charged to every user by this ledger and the other "
        "rollup levels' (8) (90 more window(s)"
    ) in status.stdout
    # the start line says what one span costs a user
    assert (
        f"a user active through one {SPAN} is charged 4 x 1 + 1 = 5 eps of ledger.budget_per_user"
    ) in res.stderr


def test_a_day_of_users_is_not_the_sum_of_its_windows(tmp_path):
    """The same users in every base window: the span counts them once."""
    path = tmp_path / "logins.jsonl"
    truth = write_logins(path, 1, seed=9)
    one = path.read_text()
    path.write_text(one * 4)  # four base windows of the same users
    res = run_cli(rollup_args(tmp_path, path, **{"state.rollup_expected_users": 3000}))
    assert res.returncode == 0, res.stderr
    (doc,) = check_level(tmp_path, LEVELS[1], SPAN, SPAN).values()
    lo, hi = doc["distinct_users"]["interval"]
    assert lo <= truth[0] <= hi and hi < 2 * truth[0]


def test_the_per_user_budget_counts_both_levels_and_refuses_past_it(tmp_path):
    path = tmp_path / "logins.jsonl"
    write_logins(path, 8, seed=5)
    res = run_cli(rollup_args(tmp_path, path, **{"ledger.budget_per_user": 6}))
    assert res.returncode == 0, res.stderr
    assert user_charges(tmp_path) <= 6.0  # never past the budget, whatever the level
    # base windows 0-3 and the first span: 5; base window 4: 6; then nothing more
    assert sorted(level_docs(tmp_path, "base")) == [0, 1, 2, 3, 4]
    assert sorted(level_docs(tmp_path, LEVELS[1])) == [0]
    refused = [
        e["note"]
        for level in LEVELS
        for e in level_ledger(tmp_path, level)
        if e["kind"] == "refused"
    ]
    assert refused and "the other rollup levels" in refused[0], refused


@pytest.mark.parametrize(
    "fault",
    [
        "checkpoint-mid-write:8",  # base window 3's close: the first span open (replayed)
        "checkpoint-after-rename:9",  # base window 3 ledgered, the span about to close
        "checkpoint-mid-write:11",  # the span's close: its release ledgered, not published
        "checkpoint-mid-write:13",  # the second span open, base window 4 ledgered
    ],
)
def test_kill_at_the_close_and_restart_releases_each_window_of_each_level_once(tmp_path, fault):
    """The levels checkpoint in turn (the failpoints count both): where the kill falls, each
    level replays its own open window into fresh bits under a fresh key."""
    path = tmp_path / "logins.jsonl"
    write_logins(path, 8, seed=5)
    args = rollup_args(tmp_path, path)
    first = run_cli(args, {"PANAGG_TEST_FAULT": fault})
    assert first.returncode == -9, first.stderr  # SIGKILLed at the fault point
    ledgered = {
        level: {
            e["window"]: e["document"]
            for e in level_ledger(tmp_path, level)
            if e["kind"] == "release"
        }
        for level in LEVELS
    }
    second = run_cli(args)
    assert second.returncode == 0, second.stderr
    for level, size in zip(LEVELS, (WINDOW, SPAN)):
        docs = check_level(tmp_path, level, size, 8 * WINDOW)
        for w, doc in ledgered[level].items():  # re-published from the ledger, never redrawn
            assert docs[w] == json.loads(doc)
    # a window replayed after the kill is charged twice (its bits were drawn twice)
    restarts = {
        (level, e["window_uid"])
        for level in LEVELS
        for e in level_ledger(tmp_path, level)
        if e["kind"] == "restart"
    }
    assert restarts
    assert user_charges(tmp_path) == 10.0 + len(restarts)
