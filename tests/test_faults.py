"""Faults an operator must see at once, without a broker: release files do not wait for the
release topic."""

import json
import re
import socket

import numpy as np
import pytest

from tests.helpers.service import D, cli_sets, run_cli, write_events


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("workers", [0, 1])
def test_release_files_are_written_while_the_release_topic_is_down(tmp_path, workers):
    items = np.random.default_rng(5).integers(0, D, 3000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(
        tmp_path,
        path,
        **{
            "window.size": 1000,
            "release.workers": workers,
            "release.topic": "releases",
            "source.bootstrap": f"127.0.0.1:{_closed_port()}",
        },
    )
    res = run_cli(args)
    # every window's file is there although no release reached the topic
    files = sorted(p.name for p in (tmp_path / "releases").glob("release-*.json"))
    assert files == ["release-0.json", "release-1.json", "release-2.json"], res.stderr
    assert [json.loads((tmp_path / "releases" / f).read_text())["n"] for f in files] == [1000] * 3
    # the run does not end looking successful: the topic still owes them
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    # the reason: the sender's last failure if it had one by then (a loaded machine gets there:
    # KafkaTimeoutError, NoBrokersAvailable), else that the topic has not acknowledged them
    assert "3 release(s) could not be published (" in last
    assert "topic 'releases' has not acknowledged them yet)" in last or re.search(
        r"\(window \d+: \w+\)", last
    ), last
    assert last.endswith(
        "); they stay in the checkpoint and are published at the next start once the cause is fixed"
    )


def test_a_refused_start_leaves_no_directory_behind(tmp_path):
    """A state directory lost (deleted) while its releases stay: the next start is refused by
    the ledger's anchor in release.dir, and writes nothing: not even the new, empty state
    directory, its lock file, control directory or metrics URL."""
    import shutil

    items = np.random.default_rng(6).integers(0, D, 2000)
    path = tmp_path / "events.jsonl"
    write_events(path, items)
    args = cli_sets(tmp_path, path, **{"window.size": 1000, "metrics.port": 0})
    assert run_cli(args).returncode == 0
    shutil.rmtree(tmp_path / "state")
    res = run_cli(args)
    assert res.returncode == 2 and "the ledger" in res.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "state").exists(), sorted(p.name for p in (tmp_path / "state").iterdir())
