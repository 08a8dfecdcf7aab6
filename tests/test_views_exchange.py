"""The views exchange's pure parts (aggregator/service/group/views.py): a member's view and the
leader's sum of a window's views."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.service.group.view_format import (
    CHUNK_COUNTERS,
    decode_view,
    merge_views,
    view_header,
)
from aggregator.state import PanPrivateHistogram

INFO = {"kind": "time", "size": 60.0, "events": 0, "started_unix": 0.0, "ended_unix": 60.0}


def _view(covers, size=50, items=(), partitions=3, **kw):
    s = PanPrivateHistogram(1.0, size=size)
    s.add_indices(np.asarray(items, dtype=np.int64))
    return s, view_header(
        s,
        window=4,
        covers=covers,
        partitions=partitions,
        window_info=dict(INFO, events=len(items)),
        **kw,
    )


def test_a_view_is_the_state_plus_one_fresh_layer_in_chunks():
    size = CHUNK_COUNTERS + 10  # two chunks
    s, head = _view([0], size=size, items=[3, 3, 7])
    got = decode_view(head)
    assert head["chunks"] == 2 and head["layers"] == 2 and head["n"] == 3
    noise = got - s.counts
    assert noise.var() == pytest.approx(2 * s.p / (1 - s.p) ** 2, rel=0.1)
    assert not np.array_equal(got, s.counts)


def test_counters_past_int32_travel_as_int64():
    s = PanPrivateHistogram(1.0, size=4)
    s.add_indices(np.full(3, 1, dtype=np.int64))
    s._counts[2] += 2**40  # a test reaching into the state: a huge counter
    head = view_header(s, window=1, covers=[0], partitions=1, window_info=INFO)
    assert head["dtype"] == "<i8" and decode_view(head)[2] > 2**39


def test_the_sum_of_views_adds_their_layers_and_events():
    _, a = _view([0, 2], items=[1, 1, 2])
    _, b = _view([1], items=[1])
    rel = merge_views([a, b], error_bar_reps=0)
    assert (rel["n"], rel["layers"], rel["exchange"]["views"]) == (4, 4, 2)
    assert rel["window_info"]["events"] == 4


def test_a_window_with_no_counted_event_gets_one_processs_two_layers():
    s, _ = _view([0])
    empty = [
        view_header(None, window=4, covers=[p], partitions=2, window_info=INFO, size=50, params=s)
        for p in (0, 1)
    ]
    rel = merge_views(empty, error_bar_reps=0)
    assert (rel["n"], rel["layers"], rel["exchange"]["views"]) == (0, 2, 0)


@pytest.mark.parametrize(
    "covers,said",
    [
        ([[0], [1]], "needs views of partitions 0..2 once each"),
        ([[0, 1], [1, 2]], "once each"),
    ],
)
def test_a_window_is_merged_only_when_its_views_cover_each_partition_once(covers, said):
    views = [_view(c)[1] for c in covers]
    with pytest.raises(ValueError, match=said):
        merge_views(views, error_bar_reps=0)


def test_views_of_other_domains_are_not_summed():
    _, a = _view([0, 1])
    _, b = _view([2], size=60)
    with pytest.raises(ValueError, match="disagree on size"):
        merge_views([a, b], error_bar_reps=0)
