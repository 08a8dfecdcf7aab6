"""Is the change between two windows' releases real? A test on the difference of two estimates.

Two releases of the same stream are two noisy estimates. Their difference moves even when nothing
changed: each release carries the noise of its own counters (and, across windows, the sampling of
different events from the same distribution). A change is reported only when the difference is
larger than that movement allows at a stated level; otherwise "no significant change".

The test
--------
For a statistic T (distinct items, entropy) with releases a (earlier) and b (later), each with a
standard error s (``accuracy.standard_error``: the standard deviation of the release's bootstrap
re-estimates, :func:`aggregator.intervals.error_bars`), the statistic

    t = (T_b - T_a) / sqrt(s_a^2 + s_b^2 + v_a + v_b)

is compared with the Student-t quantile at (1 + level) / 2 with Welch-Satterthwaite degrees of
freedom (each s comes from m bootstrap draws, m - 1 degrees of freedom). v is the sampling
variance of T between two windows of the same distribution (:func:`sampling_variance`); the
bootstrap holds the window's items fixed, so it does not contain it. Under "no change" the two
estimates share their estimator's bias (same truth, same estimator), so the bias cancels in the
difference and only the spreads count: that is why the test uses the spreads and not the
intervals (which carry the bias and are much wider). The false-alarm rate on stationary streams is
measured in docs/accuracy_changes.md ("Changes between windows").

A release without standard errors (written before they existed, or with the bootstrap off) is
tested on its interval instead: its half-width over the normal quantile of the interval's level is
taken as the standard error (wider: a conservative test). Without either the result is
"unknown" and nothing is claimed.

Everything here reads released values only: post-processing, no privacy cost.

>>> a = {"properties": {"distinct_items": 1000, "entropy_nats": 6.0},
...      "accuracy": {"standard_error": {"distinct_items": 30.0, "entropy_nats": 0.01},
...                   "intervals": {"reps": 10}}}
>>> b = {"properties": {"distinct_items": 1040, "entropy_nats": 6.2},
...      "accuracy": a["accuracy"]}
>>> c = compare(a, b, level=0.9)
>>> c["distinct_items"]["significant"], c["entropy_nats"]["significant"]
(False, True)
>>> c["entropy_nats"]["direction"]
1
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

from scipy.special import stdtrit

__all__ = ["STATISTICS", "LEVEL", "compare", "standard_error", "sampling_variance", "describe"]

STATISTICS = ("distinct_items", "entropy_nats")
LEVEL = 0.9  # the default level of the test: at most 10% false alarms on a stationary stream


def _pairs(release: dict):
    return (release.get("histogram") or {}).get("pairs") or []


def sampling_variance(release: dict, statistic: str) -> float:
    """Variance of ``statistic`` between two windows drawn from the same distribution, estimated
    from the released histogram (0 when it holds nothing).

    Distinct items: each item is seen in a window or not, and the indicators are negatively
    correlated for a fixed number of events, so the count of seen items varies by less than a
    Poisson count: its variance is at most its mean, taken as the bound (the items seen once
    and twice dominate it). Entropy: the delta method for the plug-in entropy of n draws,
    (sum_i q_i log^2 q_i - H^2) / n with q_i = h_i / n.
    """
    pairs = _pairs(release)
    n = sum(r * c for r, c in pairs)
    if not n:
        return 0.0
    if statistic == "distinct_items":
        return float(sum(c for _, c in pairs))
    if statistic == "entropy_nats":
        h = sum(c * (r / n) * math.log(r / n) for r, c in pairs)  # -H
        m2 = sum(c * (r / n) * math.log(r / n) ** 2 for r, c in pairs)
        return max(m2 - h * h, 0.0) / n
    raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")


def standard_error(release: dict, statistic: str) -> tuple[float | None, float]:
    """(standard error, degrees of freedom) of ``statistic`` in ``release``: the bootstrap's
    spread with reps - 1 degrees of freedom, else the interval's half-width over its normal
    quantile (infinite degrees of freedom), else (None, 0)."""

    acc = release.get("accuracy") or {}
    iv = acc.get("intervals") or {}
    se = (acc.get("standard_error") or {}).get(statistic)
    if se is not None:
        return float(se), max(int(iv.get("reps") or 10) - 1, 1)
    bounds = iv.get(statistic)
    if bounds:
        z = NormalDist().inv_cdf(0.5 + float(iv.get("level", 0.9)) / 2)
        return (float(bounds[1]) - float(bounds[0])) / (2 * z), math.inf
    return None, 0


def compare(before: dict, after: dict, level: float = LEVEL) -> dict:
    """Per statistic: the change from ``before`` to ``after`` and whether it is significant at
    ``level`` (two-sided; module docstring).

    Returns {statistic: {"before", "after", "change", "relative" (change / before, None when
    before is 0), "threshold" (the smallest |change| that is significant), "significant"
    (True / False, None when a release has no error figure), "direction" (+1 / -1 when
    significant, 0 when not, None when unknown)}, "level": level}.
    """

    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    out: dict = {"level": level}
    for stat in STATISTICS:
        x0 = (before.get("properties") or {}).get(stat)
        x1 = (after.get("properties") or {}).get(stat)
        row: dict[str, Any] = {
            "before": x0,
            "after": x1,
            "change": None,
            "relative": None,
            "threshold": None,
            "significant": None,
            "direction": None,
        }
        out[stat] = row
        if x0 is None or x1 is None:
            continue
        row["change"] = x1 - x0
        row["relative"] = (x1 - x0) / x0 if x0 else None
        (s0, d0), (s1, d1) = standard_error(before, stat), standard_error(after, stat)
        if s0 is None or s1 is None:
            continue
        b0, b1 = s0 * s0, s1 * s1
        var = b0 + b1 + sampling_variance(before, stat) + sampling_variance(after, stat)
        # Welch-Satterthwaite: only the bootstrap parts are estimated from few draws
        den = (b0 * b0 / d0 if d0 < math.inf else 0.0) + (b1 * b1 / d1 if d1 < math.inf else 0.0)
        df = (b0 + b1) ** 2 / den if den > 0 else math.inf
        q = 0.5 + level / 2
        crit = float(stdtrit(df if df < math.inf else 1e9, q))
        row["threshold"] = crit * math.sqrt(var)
        significant = abs(row["change"]) > row["threshold"]
        row["significant"] = bool(significant)
        row["direction"] = (1 if row["change"] > 0 else -1) if significant else 0
    return out


def describe(comparison: dict, statistic: str = "distinct_items") -> str:
    """One phrase for a history line: "+12.0% distinct items (significant at 0.9)", "no
    significant change in distinct items (+3.1%, within +-5.2%)", or "" when unknown."""
    row = comparison.get(statistic) or {}
    name = statistic.replace("_nats", "").replace("_", " ")
    if row.get("significant") is None:
        return ""
    if row["before"]:
        moved = f"{100 * row['relative']:+.1f}%"
        within = f"+-{100 * row['threshold'] / abs(row['before']):.1f}%"
    else:
        moved, within = f"{row['change']:+,.4g}", f"+-{row['threshold']:,.4g}"
    if row["significant"]:
        return f"{moved} {name} (significant at {comparison['level']:g})"
    return f"no significant change in {name} ({moved}, within {within})"
