"""The release gate (aggregator/service/release_gate.py) on a real ledger: a release is charged
by the source positions it covers, whatever its window number or uid; the stream's other
aggregations and the windows in the release worker count; a refusal is ledgered with its ranges
and given again to every later asker."""

from __future__ import annotations

import pytest

from aggregator.service.ledger import Ledger
from aggregator.service.metrics import Metrics
from aggregator.service.release_gate import ReleaseGate, covered_ranges

EPS = 1.0


def gate_in(directory, name="", budget_per_event=EPS):
    directory.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(
        directory / "ledger.jsonl", budget_per_window=EPS, budget_per_event=budget_per_event
    )
    return ReleaseGate(
        ledger,
        Metrics(),
        epsilon=EPS,
        model="joint",
        stream="kafka:logins",
        aggregation=name,
        directory=directory,
    )


def closing(events=10, lineage="L1", kind="count"):
    return {"events": events, "lineage": lineage, "kind": kind}


def release(gate, uid, wid, ranges, window=None):
    """What a close does once the gate allows: the release entry with its position fields."""
    window = window or closing()
    fields = gate.position_fields(
        window, ranges, {p: r[1] for p, r in ranges.items()}, {"events": 0, "rejects": {}}
    )
    gate.ledger.append(
        entry_id=f"release-{uid}",
        kind="release",
        window=wid,
        window_uid=uid,
        epsilon_spent=gate.charge_of(window),
        model="joint",
        document="{}",
        **fields,
    )


def test_covered_ranges_are_the_positions_counted_from_each_partitions_start():
    assert covered_ranges({"p0": 5, "p1": 9}, {"p0": 12, "p1": 9, "p2": 4}) == {"p0": [5, 12]}
    assert covered_ranges(None, {"p0": 12}) == {}


def test_a_new_uid_over_released_positions_is_refused_and_the_refusal_is_ledgered(tmp_path):
    gate = gate_in(tmp_path / "a")
    assert gate.allows("u1", 0, ranges={"p0": [0, 100]}, charge=EPS, closing=closing())
    release(gate, "u1", 0, {"p0": [0, 100]})
    # another lineage (a fresh start, a lost checkpoint) over half of those positions
    refused_fields = {"ranges": {"p0": [50, 150]}, "lineage": "L2"}
    assert not gate.allows(
        "u2",
        0,
        ranges={"p0": [50, 150]},
        charge=EPS,
        closing=closing(lineage="L2"),
        refusal_fields=lambda: refused_fields,
    )
    entry = gate.ledger.get("refused-u2")
    assert entry["kind"] == "refused" and entry["ranges"] == {"p0": [50, 150]}
    assert "released before" in entry["note"] and "p0" in entry["note"]
    assert gate.metrics.releases_refused._value.get() == 1
    # asked again (a restart), the answer is the same and nothing more is written
    n = len(gate.ledger.entries)
    assert not gate.allows(
        "u2", 0, ranges={"p0": [50, 150]}, charge=EPS, closing=closing(lineage="L2")
    )
    assert len(gate.ledger.entries) == n
    # positions never charged are allowed under the same new lineage
    assert gate.allows(
        "u3", 1, ranges={"p0": [100, 200]}, charge=EPS, closing=closing(lineage="L2")
    )


def test_windows_in_the_release_worker_count_as_charged(tmp_path):
    gate = gate_in(tmp_path / "a")
    flying = [
        {"charge": EPS, "ranges": {"p0": [0, 100]}, "window": {"lineage": "L1", "kind": "count"}}
    ]
    assert not gate.allows(
        "u2",
        1,
        ranges={"p0": [90, 120]},
        charge=EPS,
        closing=closing(lineage="L9"),
        in_flight=flying,
    )
    # negative control: without the job in flight the same positions are free
    assert gate.allows("u3", 1, ranges={"p0": [90, 120]}, charge=EPS, closing=closing(lineage="L9"))


def test_other_aggregations_of_the_stream_charge_the_same_events(tmp_path):
    users, ips = (
        gate_in(tmp_path / "set" / "users", "users"),
        gate_in(tmp_path / "set" / "ips", "ips"),
    )
    release(users, "u1", 0, {"p0": [0, 100]})
    assert [e["window_uid"] for e in ips.other_charges() if e["kind"] == "release"] == ["u1"]
    # at a per-event budget of one release, the other aggregation's window is refused
    assert not ips.allows("i1", 0, ranges={"p0": [0, 100]}, charge=EPS, closing=closing())
    # with room for two looks at each event it is allowed
    roomy = gate_in(tmp_path / "set" / "roomy", "roomy", budget_per_event=2 * EPS)
    assert roomy.allows("r1", 0, ranges={"p0": [0, 100]}, charge=EPS, closing=closing())
    # a single aggregation reads no sibling ledgers
    assert gate_in(tmp_path / "set" / "alone").other_charges() == []


def test_a_window_without_events_is_charged_nothing(tmp_path):
    gate = gate_in(tmp_path / "a")
    assert gate.charge_of(closing(events=0)) == 0.0 and gate.charge_of(closing()) == EPS


def test_a_damaged_sibling_ledger_stops_with_one_line(tmp_path):
    ips = gate_in(tmp_path / "set" / "ips", "ips")
    (tmp_path / "set" / "users").mkdir(parents=True)
    (tmp_path / "set" / "users" / "ledger.jsonl").write_text("not json\n")
    from aggregator.service.errors import ServiceError

    with pytest.raises(ServiceError, match="another aggregation's ledger"):
        ips.other_charges()
