"""A change between windows is reported only when it is significant (issue 28): the test itself,
`panagg history`'s lines and plot, and the Prometheus series."""

from __future__ import annotations

import json
import math

import pytest

from aggregator import changes
from aggregator.service.status import format_history, plot_history, release_history


def _doc(window, distinct, entropy, se_d=None, se_h=None, interval=None, reps=10):
    acc = {"intervals": {"reps": reps, "level": 0.9}}
    if se_d is not None:
        acc["standard_error"] = {"distinct_items": se_d, "entropy_nats": se_h}
    if interval is not None:
        acc["intervals"]["distinct_items"] = interval
    return {
        "window": window,
        "n": 1000,
        "properties": {"distinct_items": distinct, "entropy_nats": entropy},
        "accuracy": acc,
        "signal_below_noise": False,
    }


class _Ledger:
    def __init__(self, docs, t0=1_795_000_000.0):
        self.entries = [
            {"kind": "release", "time_unix": t0 + 30 * i, "document": json.dumps(d)}
            for i, d in enumerate(docs)
        ]


def test_no_change_within_the_noise_and_a_change_beyond_it():
    a = _doc(1, 1000, 5.0, se_d=40.0, se_h=0.02)
    same = changes.compare(a, _doc(2, 1060, 5.01, se_d=40.0, se_h=0.02))
    assert same["distinct_items"]["significant"] is False
    assert same["distinct_items"]["direction"] == 0
    assert same["distinct_items"]["relative"] == pytest.approx(0.06)
    up = changes.compare(a, _doc(2, 1400, 4.5, se_d=40.0, se_h=0.02))
    assert up["distinct_items"]["direction"] == 1 and up["entropy_nats"]["direction"] == -1


def test_threshold_grows_with_the_standard_errors_and_the_level():
    a, b = _doc(1, 1000, 5.0, se_d=40.0, se_h=0.02), _doc(2, 1000, 5.0, se_d=40.0, se_h=0.02)
    wide = changes.compare(a, _doc(2, 1000, 5.0, se_d=80.0, se_h=0.02))
    base = changes.compare(a, b)
    strict = changes.compare(a, b, level=0.99)
    t = base["distinct_items"]["threshold"]
    assert wide["distinct_items"]["threshold"] > t and strict["distinct_items"]["threshold"] > t
    # at least sqrt(2) standard errors times the normal quantile at 0.95 (t > z, and the
    # sampling variance of a window adds to it)
    assert t > 1.6449 * math.sqrt(2) * 40.0


def test_without_error_figures_nothing_is_claimed_and_intervals_stand_in():
    a, b = _doc(1, 1000, 5.0), _doc(2, 3000, 5.0)
    c = changes.compare(a, b)
    assert c["distinct_items"]["significant"] is None and changes.describe(c) == ""
    a = _doc(1, 1000, 5.0, interval=[900, 1100])
    b = _doc(2, 3000, 5.0, interval=[2700, 3300])
    assert changes.compare(a, b)["distinct_items"]["direction"] == 1


def test_level_is_checked():
    with pytest.raises(ValueError, match="level must be in"):
        changes.compare(_doc(1, 1, 1.0), _doc(2, 1, 1.0), level=90)


def test_history_names_only_significant_changes(tmp_path):
    docs = [
        _doc(59849607, 1000, 5.0, se_d=40.0, se_h=0.02),
        _doc(59849608, 1030, 5.0, se_d=40.0, se_h=0.02),
        _doc(59849609, 2000, 5.0, se_d=40.0, se_h=0.02),
    ]
    rows = release_history(_Ledger(docs))
    assert rows[0]["change"] is None
    assert rows[1]["change"]["distinct_items"]["significant"] is False
    assert rows[2]["change"]["distinct_items"]["direction"] == 1
    lines = format_history(rows)
    assert lines[1].endswith(
        "; vs window 59849607 at level 0.9: distinct: no significant "
        "change, entropy: no significant change"
    )
    assert lines[2].endswith(
        "; vs window 59849608 at level 0.9: distinct +94.2% (significant), "
        "entropy: no significant change"
    )
    plot_history(rows, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_history_plot_axis_reads_as_times_not_window_numbers(tmp_path, monkeypatch):
    """Window numbers like 59849607 made the x axis unreadable: it shows release times."""
    from matplotlib.figure import Figure

    seen = {}
    real = Figure.savefig

    def keep(fig, path, *a, **k):
        fig.canvas.draw()
        ax = fig.axes[1]
        seen["xlabel"] = ax.get_xlabel()
        seen["ticks"] = [t.get_text() for t in ax.get_xticklabels()]
        return real(fig, path, *a, **k)

    monkeypatch.setattr(Figure, "savefig", keep)
    docs = [_doc(59849607 + i, 1000 + 5 * i, 5.0, se_d=40.0, se_h=0.02) for i in range(6)]
    plot_history(release_history(_Ledger(docs)), tmp_path / "h.png")
    assert seen["xlabel"] == "release time (UTC)"
    assert not any("5984960" in t for t in seen["ticks"])


def test_prometheus_change_gauge():
    from aggregator.service.metrics import Metrics

    m = Metrics()

    def gauge():
        return {
            s: m.registry.get_sample_value("panagg_release_change", {"statistic": s})
            for s in changes.STATISTICS
        }

    assert all(math.isnan(v) for v in gauge().values())  # nothing to compare yet
    m.published(_doc(1, 1000, 5.0, se_d=40.0, se_h=0.02))
    assert all(math.isnan(v) for v in gauge().values())
    m.published(_doc(2, 1010, 5.0, se_d=40.0, se_h=0.02))
    assert gauge() == {"distinct_items": 0.0, "entropy_nats": 0.0}
    m.published(_doc(3, 700, 5.3, se_d=40.0, se_h=0.02))
    assert gauge() == {"distinct_items": -1.0, "entropy_nats": 1.0}
