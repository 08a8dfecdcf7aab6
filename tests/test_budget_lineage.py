"""One event, one charge across lineages (issue 48): a file keeps its charges by content (renamed,
moved, grown, read from a new state directory), a new Kafka topic is new data unless the operator
says it holds the old one's records (--same-records-as), and the release directory's anchor is
keyed by the ledger's id, not its path (docs/privacy.md section 22).

Each figure is events released / events produced, counted from the published release files.
"""

import json
import logging
import shutil
import time

import numpy as np
import pytest

from aggregator.service import Aggregator
from aggregator.service.config import load_config
from consumers.base import Segment, Source
from state_store.registry import FileBudgetRegistry

from tests.helpers.service import D, cli_sets, run_cli, write_events


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def _events(path, n, seed=48):
    write_events(path, np.random.default_rng(seed).integers(0, D, n))


def _released(release_dir) -> int:
    """Events in the releases published in ``release_dir``."""
    return sum(json.loads(p.read_text())["n"] for p in sorted(release_dir.glob("release-*.json")))


def _args(tmp_path, path, state="state", releases="releases", **sets):
    return cli_sets(
        tmp_path,
        path,
        **{
            "window.size": 100,
            "release.on_exhausted": "false",
            "checkpoint.dir": tmp_path / state,
            "release.dir": tmp_path / releases,
            **sets,
        },
    )


def _one_error_line(res) -> str:
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("panagg: error: ")
    return line


# -- files: identity by content -----------------------------------------------------------------


def test_identity_by_content_survives_rename_and_appends_not_an_edit(tmp_path):
    reg = FileBudgetRegistry(tmp_path / "reg.jsonl", {"state_dir": "/s"})
    reg.open()
    a = tmp_path / "a.jsonl"
    _events(a, 300)
    cid = reg.identify("file:a.jsonl", a)
    reg.record(
        "L1",
        {
            "id": "release-1",
            "kind": "release",
            "epsilon_spent": 1.0,
            "ranges": {"file:a.jsonl": [0, 300]},
            "sources": {"file:a.jsonl": cid},
        },
    )
    b = tmp_path / "moved" / "b.jsonl"
    b.parent.mkdir()
    shutil.copy(a, b)
    with open(b, "a") as f:  # grown by appends after the move
        f.write(json.dumps({"item": 1}) + "\n")
    again = FileBudgetRegistry(tmp_path / "reg.jsonl", {"state_dir": "/t"})
    again.open()
    assert again.identify("file:b.jsonl", b) == cid
    assert again.resume_offsets(1.0, budget=1.0) == {"file:b.jsonl": 300}
    edited = tmp_path / "c.jsonl"
    edited.write_bytes(b"x" + a.read_bytes()[1:])  # one byte inside the prefix
    assert again.identify("file:c.jsonl", edited) != cid
    assert again.resume_offsets(1.0, budget=1.0) == {}


@pytest.mark.parametrize("registry", ["auto", ""])
def test_renamed_file_in_a_new_state_dir_is_not_released_again(tmp_path, registry):
    path = tmp_path / "events.jsonl"
    _events(path, 300)
    sets = {"ledger.file_registry": registry}
    assert run_cli(_args(tmp_path, path, **sets)).returncode == 0
    assert _released(tmp_path / "releases") == 300
    moved = tmp_path / "elsewhere" / "renamed.jsonl"
    moved.parent.mkdir()
    path.rename(moved)
    res = run_cli(_args(tmp_path, moved, state="state2", releases="releases2", **sets))
    assert res.returncode == 0, res.stderr
    second = _released(tmp_path / "releases2")
    if registry == "":  # the control: nothing knows the content (what main did by default)
        assert second == 300
        return
    assert second == 0  # 300 released / 300 produced
    said = [x for x in res.stderr.splitlines() if "was read and released before" in x]
    assert (
        len(said) == 1 and f"state dir {tmp_path / 'state'}" in said[0] and str(path) in said[0]
    ), res.stderr


def test_renamed_file_under_accept_change_resumes_where_it_was(tmp_path):
    path = tmp_path / "events.jsonl"
    _events(path, 300)
    assert run_cli(_args(tmp_path, path)).returncode == 0
    moved = tmp_path / "renamed.jsonl"
    path.rename(moved)
    with open(moved, "a") as f:  # and it grew meanwhile: only the new records are new
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in range(100)))
    args = _args(tmp_path, moved)
    line = _one_error_line(run_cli(args))
    assert "--accept-change" in line  # the change is refused without the flag
    res = run_cli(args + ["--accept-change"])
    assert res.returncode == 0, res.stderr
    assert _released(tmp_path / "releases") == 400  # 400 released / 400 produced
    assert "counting resumes at its position 300" in res.stderr
    assert "released again" not in res.stderr  # the warning says what happens: charged


def test_a_new_state_dir_over_a_copy_with_budget_two_releases_once_more(tmp_path):
    path = tmp_path / "events.jsonl"
    _events(path, 300)
    sets = {"ledger.budget_per_window": 1, "ledger.budget_per_event": 2}
    assert run_cli(_args(tmp_path, path, **sets)).returncode == 0
    copy = tmp_path / "copy.jsonl"
    shutil.copy(path, copy)
    for k in (2, 3):
        res = run_cli(_args(tmp_path, copy, state=f"state{k}", releases=f"releases{k}", **sets))
        assert res.returncode == 0, res.stderr
    # composition counted: 2 eps per event at most, so the third run releases nothing
    assert [_released(tmp_path / r) for r in ("releases", "releases2", "releases3")] == [
        300,
        300,
        0,
    ]


# -- anchors: by the ledger's id ----------------------------------------------------------------


def test_state_dir_restored_to_another_path_is_recognised_by_its_anchor(tmp_path):
    path = tmp_path / "events.jsonl"
    _events(path, 200)
    assert run_cli(_args(tmp_path, path)).returncode == 0  # windows 0-1
    shutil.copytree(tmp_path / "state", tmp_path / "backup")
    with open(path, "a") as f:
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in range(200)))
    assert run_cli(_args(tmp_path, path)).returncode == 0  # windows 2-3
    assert _released(tmp_path / "releases") == 400
    shutil.copytree(tmp_path / "backup", tmp_path / "restored")  # at another path
    line = _one_error_line(run_cli(_args(tmp_path, path, state="restored")))
    assert "truncated or rolled back" in line and ".panagg-ledger-head-" in line, line
    assert _released(tmp_path / "releases") == 400


def test_a_deleted_anchor_does_not_let_a_restored_state_dir_release_twice(tmp_path):
    path = tmp_path / "events.jsonl"
    _events(path, 200)
    assert run_cli(_args(tmp_path, path)).returncode == 0
    shutil.copytree(tmp_path / "state", tmp_path / "backup")
    with open(path, "a") as f:
        f.write("".join(json.dumps({"item": int(i)}) + "\n" for i in range(200)))
    assert run_cli(_args(tmp_path, path)).returncode == 0
    shutil.rmtree(tmp_path / "state")
    shutil.copytree(tmp_path / "backup", tmp_path / "restored")
    for anchor in (tmp_path / "releases").glob(".panagg-ledger-head-*"):
        anchor.unlink()
    res = run_cli(_args(tmp_path, path, state="restored"))
    assert res.returncode == 0, res.stderr
    # windows 2-3 replayed: refused by the registry's charges, each in one line naming the run
    assert _released(tmp_path / "releases") == 400  # 400 released / 400 produced
    refused = [x for x in res.stderr.splitlines() if " ERROR " in x]
    assert len(refused) == 2 and all(f"state dir {tmp_path / 'state'}" in x for x in refused)


# -- Kafka topics: --same-records-as ------------------------------------------------------------


class _Topic(Source):
    """A finite Kafka-like topic of one partition: ``<topic>:0``."""

    def __init__(self, topic: str, items):
        self.part = f"{topic}:0"
        self.values = [json.dumps({"item": int(i)}).encode() for i in items]
        self.pos = 0

    def seek(self, offsets):
        self.pos = int(offsets.get(self.part, 0))

    def poll(self, timeout_s: float = 1.0):
        if self.pos >= len(self.values):
            time.sleep(min(timeout_s, 0.05))
            return []
        seg = Segment(self.part, range(self.pos, len(self.values)), self.values[self.pos :])
        self.pos = len(self.values)
        return [seg]


def _kafka_run(tmp_path, topic, items, **start):
    cfg = load_config(
        None,
        [
            "source.kind=kafka",
            f"source.topic={topic}",
            "source.format=json",
            "window.kind=count",
            "window.size=100",
            f"state.domain_size={D}",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.error_bar_reps=0",
            "release.workers=0",
            "release.plan_errors=false",
        ],
    )
    Aggregator(cfg, _Topic(topic, items), **start).run(idle_exit_s=0.5)


@pytest.mark.parametrize("same", [True, False])
def test_a_copied_topic_is_charged_as_the_old_one_only_when_said(tmp_path, caplog, same):
    items = np.random.default_rng(7).integers(0, D, 400)
    _kafka_run(tmp_path, "t1", items)
    assert _released(tmp_path / "releases") == 400
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="panagg.service"):
        _kafka_run(
            tmp_path, "t2", items, accept_change=True, **({"same_records_as": "t1"} if same else {})
        )
    warned = [r.getMessage() for r in caplog.records if "source.topic changed" in r.message]
    assert len(warned) == 1
    if same:
        assert _released(tmp_path / "releases") == 400  # 400 released / 400 produced
        assert "with --same-records-as t1" in warned[0]
        refused = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(refused) == 4  # each window of t2, one line each
    else:
        # the operator did not say: new data, and the warning says exactly that
        assert _released(tmp_path / "releases") == 800
        assert "count as new data" in warned[0] and "--same-records-as t1" in warned[0]


def test_same_records_as_names_the_topic_the_state_dir_counted(tmp_path):
    items = np.random.default_rng(7).integers(0, D, 100)
    _kafka_run(tmp_path, "t1", items)
    from aggregator.service.errors import ServiceError

    with pytest.raises(ServiceError, match="counted topic t1, not t0"):
        _kafka_run(tmp_path, "t2", items, accept_change=True, same_records_as="t0")
