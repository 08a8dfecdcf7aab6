"""The fault harness's one invariant (tests/chaos/invariant.py) on fabricated ledgers, with no
broker: source records deleted before they were counted are accounted for only where a
refused or withheld entry names them, and only if the source no longer holds them. The negative
controls: the same gap left unnamed, named where the records are still there, or released over,
is a violation; so the harness's ``source_retention`` runs (docs/chaos.md) cannot pass on a
silent loss."""

from __future__ import annotations

from tests.chaos.invariant import check_aggregation, check_source_spans, named_deleted

SRC = "src"


def release(w: int, a: int, b: int, part: int = 0) -> dict:
    return {
        "kind": "release",
        "window": w,
        "n": b - a,
        "ranges": {f"{SRC}:{part}": [a, b]},
        "totals": {"rejects": {}},
    }


def withheld(w: int, a: int, b: int, deleted: tuple[int, int] | None, part: int = 0) -> dict:
    """A group's withheld window over [a, b) of ``part``, naming ``deleted`` as the words of
    aggregator/service/group/deleted.py do (None: naming nothing)."""
    why = "a rebalance split its snapshot"
    if deleted is not None:
        why = (
            f"records of partition {part} from offset {deleted[0]} to {deleted[1]} were "
            f"deleted by the retention of {SRC} before they were counted; window range "
            f"[{a}, {b}) cannot be released whole"
        )
    return {"kind": "release", "window": w, "withheld": why, "ranges": {}}


def as_refused(entries: list[dict]) -> list[dict]:
    # how the harness reads a withheld entry: a refused window (tests/chaos/harness.py)
    return [dict(e, kind="refused") if e.get("withheld") else e for e in entries]


# 0..100 released, 100..400 deleted by retention while the members were down, 400..500 released;
# the source now begins at 400
ENDS, LOWS = {f"{SRC}:0": 500}, {f"{SRC}:0": 400}
DOCS = {0: [{"n": 100}], 2: [{"n": 100}]}


def test_a_range_dropped_without_a_name_is_a_violation():
    entries = as_refused([release(0, 0, 100), withheld(1, 100, 100, None), release(2, 400, 500)])
    cov = check_aggregation(entries, DOCS, ends=ENDS, lows=LOWS, begins={f"{SRC}:0": 0})
    assert cov.violations == [
        f"{SRC}:0: offsets [100, 400) between windows 0 and 2 are in no window"
    ]


def test_the_same_range_named_deleted_holds():
    entries = as_refused(
        [release(0, 0, 100), withheld(1, 100, 100, (100, 400)), release(2, 400, 500)]
    )
    cov = check_aggregation(entries, DOCS, ends=ENDS, lows=LOWS, begins={f"{SRC}:0": 0})
    assert cov.violations == []
    assert cov.deleted == 300
    assert cov.released_events == 200


def test_a_name_covering_only_part_of_the_gap_leaves_the_rest_a_violation():
    entries = as_refused(
        [release(0, 0, 100), withheld(1, 100, 100, (250, 400)), release(2, 400, 500)]
    )
    cov = check_aggregation(entries, DOCS, ends=ENDS, lows=LOWS, begins={f"{SRC}:0": 0})
    assert cov.violations == [
        f"{SRC}:0: offsets [100, 250) between windows 0 and 2 are in no window"
    ]


def test_records_named_deleted_that_the_source_still_holds_are_a_violation():
    entries = as_refused(
        [release(0, 0, 100), withheld(1, 100, 100, (100, 400)), release(2, 400, 500)]
    )
    cov = check_aggregation(entries, DOCS, ends=ENDS, lows={f"{SRC}:0": 300})
    assert cov.violations == [
        f"window 1 names {SRC}:0 offsets [100, 400) deleted, but the "
        "source still holds [300, 400) (it begins at 300)"
    ]


def test_a_window_released_over_records_named_deleted_is_a_violation():
    # views: the withheld window takes the deleted span; a release over it would be short
    entries = as_refused(
        [release(0, 0, 100), withheld(1, 100, 400, (100, 400)), release(2, 300, 500)]
    )
    entries[1]["ranges"] = {f"{SRC}:0": [100, 300]}
    cov = check_aggregation(entries, {0: [{"n": 100}], 2: [{"n": 200}]}, ends=ENDS, lows=LOWS)
    assert (
        f"window 2: released over {SRC}:0 offsets [300, 400), which window 1 names deleted "
        "before they were counted"
    ) in cov.violations


def test_items_every_source_offset_is_counted_once_or_named_deleted():
    # the items exchange: repartition messages name the source positions they came from, each
    # poll's span once on every repartition partition
    counted = {f"{SRC}:0": [(0, 60), (60, 100), (60, 100), (400, 500)]}
    entries = [withheld(7, 0, 0, (100, 400))]
    assert check_source_spans(counted, {}, ENDS, LOWS) == [
        f"{SRC}:0: offsets [100, 400) were neither counted nor named deleted"
    ]
    assert check_source_spans(counted, named_deleted(entries), ENDS, LOWS) == []
    doubled = {f"{SRC}:0": counted[f"{SRC}:0"] + [(90, 120)]}
    assert check_source_spans(doubled, named_deleted(entries), ENDS, LOWS) == [
        f"{SRC}:0: offsets [90, 100) were counted twice",
        f"{SRC}:0: offsets [100, 120) were counted and named deleted (window 7)",
    ]
