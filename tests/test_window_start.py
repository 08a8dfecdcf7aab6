"""Issue 54: every release document says when its window was, whatever the mode.

Window ids are numbered per mode (one process: 0, 1, 2 from its first window; a scale-out group:
epoch-aligned numbers, ``start // window.size``), so a consumer reading releases of both cannot
order or join them by id. Every service release therefore carries ``window_start`` and
``window_end`` (ISO 8601 UTC): the records' time for event-time windows, else the clock that
opened and closed the window.
"""

from __future__ import annotations

import datetime as dt
import json
from types import SimpleNamespace

import numpy as np
import pytest

from aggregator.release import stamp_window
from aggregator.service import Aggregator
from aggregator.service.config import load_config
from aggregator.service.group.summary import merge_summaries, partition_summary
from aggregator.service.metrics import Metrics
from aggregator.state import PanPrivateHistogram
from consumers.file_source import FileSource


def _unix(iso: str) -> float:
    assert iso.endswith("Z"), iso
    return dt.datetime.fromisoformat(iso[:-1] + "+00:00").timestamp()


@pytest.fixture(autouse=True)
def testing_env(monkeypatch):
    monkeypatch.setenv("PANAGG_TESTING", "1")


def test_stamp_window_uses_the_records_time_for_event_time_windows():
    rel = {
        "window": 7,
        "window_info": {
            "kind": "event_time",
            "size": 60.0,
            "started_unix": 1000.5,
            "ended_unix": 1090.25,
            "event_start_unix": 420.0,
            "event_end_unix": 480.0,
        },
    }
    stamp_window(rel)
    assert rel["window_start"] == "1970-01-01T00:07:00.000Z"
    assert rel["window_end"] == "1970-01-01T00:08:00.000Z"
    rel = {
        "window": 0,
        "window_info": {"kind": "time", "size": 60.0, "started_unix": 1000.5, "ended_unix": 1060.5},
    }
    stamp_window(rel)
    assert (_unix(rel["window_start"]), _unix(rel["window_end"])) == (1000.5, 1060.5)
    central = {"window": "adhoc"}  # `panagg central`: no service window, left as it is
    assert stamp_window(dict(central)) == central


def test_one_process_releases_say_when_each_window_was(tmp_path):
    D = 200
    items = np.random.default_rng(3).integers(0, D, 2500)
    path = tmp_path / "events.jsonl"
    path.write_text("".join(json.dumps({"item": int(i)}) + "\n" for i in items))
    cfg = load_config(
        None,
        [
            "source.kind=file",
            f"source.path={path}",
            "source.format=json",
            "source.max_records=1000",
            f"state.domain_size={D}",
            "window.kind=count",
            "window.size=1000",
            f"checkpoint.dir={tmp_path / 'state'}",
            f"release.dir={tmp_path / 'releases'}",
            "metrics.port=-1",
            "release.workers=0",
            "state.model=state-only",
            "release.error_bar_reps=0",
        ],
    )
    Aggregator(cfg, FileSource(str(path), "json", batch=700, progress=False)).run()
    docs = [
        json.loads(p.read_text()) for p in sorted((tmp_path / "releases").glob("release-*.json"))
    ]
    assert [d["window"] for d in docs] == [0, 1, 2]
    for d in docs:
        info = d["window_info"]
        assert _unix(d["window_start"]) == pytest.approx(info["started_unix"], abs=1e-3)
        assert _unix(d["window_end"]) == pytest.approx(info["ended_unix"], abs=1e-3)
    starts = [d["window_start"] for d in docs]
    assert starts == sorted(starts)
    # the ledgered copy (what a re-publish writes) is the same document
    ledger = [json.loads(x) for x in (tmp_path / "state" / "ledger.jsonl").read_text().splitlines()]
    ledgered = [json.loads(e["document"]) for e in ledger if e["kind"] == "release"]
    assert [e["window_start"] for e in ledgered] == starts


def test_a_groups_release_says_its_epoch_aligned_window(tmp_path):
    """A group numbers time window w by the epoch (w * window.size): the document the leader
    ledgers and publishes states that start, so it lines up with one process's releases."""
    from aggregator.service.group.leader import Leader

    size, w, P, D = 60.0, 29_000_000, 2, 50
    summaries = {}
    for p in range(P):
        st = PanPrivateHistogram(1.0, size=D // P)
        st.add_indices(np.arange(10) % (D // P))
        summaries[p] = partition_summary(
            st,
            model="state-only",
            window=w,
            partition=p,
            partitions=P,
            window_info={
                "kind": "time",
                "size": size,
                "events": st.n,
                "started_unix": w * size,
                "ended_unix": (w + 1) * size,
            },
        )
    release = merge_summaries(list(summaries.values()), error_bar_reps=0)
    written = []
    lead = SimpleNamespace(
        pending={w: summaries},
        identity={"epsilon": 1.0, "model": "state-only", "lineage": "L"},
        ledger=SimpleNamespace(check_release=lambda *a, **k: None),
        registry=None,
        aggregation="",
        rollup_level=None,
        views=False,
        P=P,
        window_kind="time",
        _transact=lambda w_, have, entry, document, extra=(): written.append(document) or True,
        view_rollups=None,
        released=[],
        local_file=lambda rel, what: None,
        metrics=Metrics(),
        topics=SimpleNamespace(releases="g.panagg.releases"),
    )
    lead._entry_fields = lambda w_, have: Leader._entry_fields(lead, w_, have)
    lead._ranges = Leader._ranges
    for s in summaries.values():
        s.setdefault("ranges", {})
    Leader._publish(lead, w, release)
    (doc,) = [json.loads(d) for d in written]
    assert _unix(doc["window_start"]) == w * size
    assert _unix(doc["window_end"]) == (w + 1) * size
    assert doc["window_start"] == "2025-02-19T21:20:00.000Z"
